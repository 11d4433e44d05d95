"""What the worker answers: OpenAI's response shapes, one pydantic model each, from which both the JSON bodies
(`completion_body`, `chunk_body`) and the OpenAPI description at /openapi.json are made, so the two cannot drift.

DeskEye's own facts ride in each answer's `deskeye` field (`DeskEyeFacts`): the engine kind, the frame cache
level (`kv_cache`), whether a grammar constrained the output (`constrained`, `grammar_ms`), batching
(`batch_size`, `mean_live_rows`), `timing` in milliseconds, the OCR engine's reading (`ocr`), the OCR text a
grounded model was given (`ocr_grounding`) and the schema `retries`. What an engine did not measure is left out.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_serializer

from inference_worker.protocol.completion import CacheLevel, Completion, OcrFacts, OcrGrounding, Timing

# The bounds of DeskEye's answers (the app's schema, deskeye/prompt.py, asks for them; the OCR engine writes within
# them; tests/test_prompt.py keeps the two sides agreeing). The schema itself is the app's: the worker serves any.
SUMMARY_MAX_CHARS = 200
OBJECT_MAX_CHARS = 40
MAX_KEY_OBJECTS = 8


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class _OmitNone(_Out):
    """A body whose None fields are left out, as OpenAI leaves out what does not apply (a chunk's usage)."""

    @model_serializer(mode="wrap")
    def _omit_none(self, handler):           # no return annotation: the schema stays the model's
        return {key: value for key, value in handler(self).items() if value is not None}


# ---------------------------------------------------------------- DeskEye's facts

class DeskEyeFacts(_Out):
    """The response's `deskeye` field: CompletionFacts as the wire names them, with the retries it took. None
    values are left out at every depth (an OCR answer has no ttft_ms); `logits` (a test's aid) never travels."""
    engine: str | None = None
    kv_cache: CacheLevel | None = None
    constrained: bool | None = None
    grammar_ms: float | None = None
    batch_size: int | None = None
    mean_live_rows: float | None = None
    timing: Timing | None = None
    ocr: OcrFacts | None = None
    ocr_grounding: OcrGrounding | None = None
    retries: int = 0

    @classmethod
    def of(cls, completion: Completion) -> DeskEyeFacts:
        facts = completion.facts
        return cls(engine=facts.engine or None, kv_cache=facts.cache, constrained=facts.constrained,
                   grammar_ms=facts.grammar_ms, batch_size=facts.batch_size, mean_live_rows=facts.mean_live_rows,
                   timing=facts.timing, ocr=facts.ocr, ocr_grounding=facts.ocr_grounding,
                   retries=completion.retries)

    @model_serializer(mode="wrap")
    def _omit_none(self, handler):           # no return annotation: the schema stays the model's
        return _without_none(handler(self))


def _without_none(body: dict[str, Any]) -> dict[str, Any]:
    return {key: _without_none(value) if isinstance(value, dict) else value
            for key, value in body.items() if value is not None}


# ---------------------------------------------------------------- an answer

class AssistantMessage(_Out):
    role: Literal["assistant"]
    content: str


class Choice(_Out):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(_Out):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    deskeye: DeskEyeFacts | None = None


def usage_of(completion: Completion) -> Usage:
    return Usage(prompt_tokens=completion.prompt_tokens, completion_tokens=completion.completion_tokens,
                 total_tokens=completion.prompt_tokens + completion.completion_tokens)


def completion_body(completion: Completion, *, request_id: str, model: str, created: int) -> dict[str, Any]:
    """The JSON body of a whole (not streamed) answer."""
    return ChatCompletion(
        id=request_id, object="chat.completion", created=created, model=model,
        choices=[Choice(index=0, message=AssistantMessage(role="assistant", content=completion.text),
                        finish_reason=completion.finish_reason)],
        usage=usage_of(completion), deskeye=DeskEyeFacts.of(completion),
    ).model_dump(mode="json")


# ---------------------------------------------------------------- a streamed answer

class ChunkDelta(_OmitNone):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(_Out):
    index: int
    delta: ChunkDelta
    finish_reason: Literal["stop", "length"] | None = None     # null until the last chunk, as OpenAI sends it


class ChatCompletionChunk(_OmitNone):
    """One Server-Sent Event of a streamed answer (`data: {...}`); the stream ends with `data: [DONE]`."""
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    deskeye: DeskEyeFacts | None = None


def chunk_body(*, request_id: str, model: str, created: int, delta: ChunkDelta | None,
               finish_reason: str | None = None, usage: Usage | None = None,
               deskeye: DeskEyeFacts | None = None) -> dict[str, Any]:
    """One chat.completion.chunk; `delta=None` is the usage-only last chunk (no choices), as OpenAI sends it."""
    choices = [] if delta is None else [ChunkChoice(index=0, delta=delta, finish_reason=finish_reason)]
    return ChatCompletionChunk(id=request_id, object="chat.completion.chunk", created=created, model=model,
                               choices=choices, usage=usage, deskeye=deskeye).model_dump(mode="json")


# ---------------------------------------------------------------- the other routes

class ModelCard(_Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(_Out):
    object: Literal["list"]
    data: list[ModelCard]


class Health(_OmitNone):
    status: str
    engine: str | None = None
    model: str | None = None
    progress: str | None = None
    error: str | None = None
