"""What crosses the process boundary between the DeskEye app and the inference worker.

The wire format is OpenAI chat completions (so any OpenAI-compatible server can stand in for our
worker). This module is the single place that knows it: the worker parses requests with
`parse_chat_request`, the app builds them with `build_messages` and reads answers with
`parse_description`. The request subset the worker accepts is described by pydantic models (`ChatCompletionRequest`, also the
OpenAPI description at /openapi.json) and turned into the worker's own frozen `ChatRequest`. Pure Python:
no torch, no PIL, no I/O.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from inference_worker.errors import ProtocolError  # noqa: F401 - re-exported: the name other modules import

# A string that always closes: no control characters, at most N characters. Grammar engines ignore
# maxLength when a pattern is set, so the bound lives in the pattern itself. xgrammar (vLLM's and SGLang's default
# backend) fails to compile a bounded repeat above 128 (`{0,129}`), so a longer bound is written as a run of
# shorter repeats (`{0,100}{0,100}` for 200): the same language, and every backend (xgrammar, llguidance,
# outlines-core) compiles it (tests/test_vllm_schema_backends.py). The characters exclude `"` and `\`: outlines-core
# puts the pattern inside the JSON string's quotes as is, and with a quote in the class its automaton explodes
# (no index after 5 minutes); without them the raw JSON text is the decoded text, so all backends agree exactly.
SUMMARY_MAX_CHARS = 200
OBJECT_MAX_CHARS = 40
MAX_KEY_OBJECTS = 8
MAX_GRAMMAR_REPEAT = 128
_TEXT_CHAR = '[^\\u0000-\\u001f"\\\\]'   # printable, and no quote or backslash: see below


def bounded_text_pattern(min_chars: int, max_chars: int) -> str:
    """`^X{min,max}$` for a printable character X, with every bounded repeat at most MAX_GRAMMAR_REPEAT."""
    num_runs = -(-max_chars // MAX_GRAMMAR_REPEAT)
    runs = []
    for index in range(num_runs):
        run_max = max_chars // num_runs + (1 if index < max_chars % num_runs else 0)
        run_min = min(min_chars, run_max) if index == 0 else 0
        runs.append(f"{_TEXT_CHAR}{{{run_min},{run_max}}}")
    return "^" + "".join(runs) + "$"


DESKEYE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "summary": {"type": "string", "pattern": bounded_text_pattern(0, SUMMARY_MAX_CHARS)},
        "key_objects": {
            "type": "array",
            "items": {"type": "string", "pattern": bounded_text_pattern(1, OBJECT_MAX_CHARS)},
            "maxItems": MAX_KEY_OBJECTS,
        },
    },
    "required": ["summary", "key_objects"],
    "additionalProperties": False,
}
DESKEYE_SCHEMA_NAME = "deskeye_description"
JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}

DEFAULT_MAX_TOKENS = 256
SUPPORTED_IMAGE_MIME = ("image/png", "image/jpeg", "image/webp", "image/bmp", "image/gif")


# ---------------------------------------------------------------- requests (worker side)

@dataclass(frozen=True)
class ImagePart:
    """An image as sent: raw encoded bytes (PNG/JPEG/…) and its declared MIME type."""
    data: bytes
    mime: str


@dataclass(frozen=True)
class Message:
    role: str                            # "system" | "user" | "assistant"
    parts: tuple[str | ImagePart, ...]   # text and images, in order

    @property
    def text(self) -> str:
        return "\n".join(p for p in self.parts if isinstance(p, str))

    @property
    def images(self) -> list[ImagePart]:
        return [p for p in self.parts if isinstance(p, ImagePart)]


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0             # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                       # 0 = off
    seed: int | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: tuple[Message, ...]
    sampling: SamplingParams
    json_schema: dict[str, Any] | None = None   # None = free text
    schema_name: str | None = None
    stream: bool = False                        # answer as Server-Sent Events, chunk by chunk
    include_usage: bool = False                 # stream_options.include_usage: a last chunk with usage
    deskeye: dict[str, Any] | None = None       # the request's DeskEye extension (window facts, ...)

    @property
    def images(self) -> list[ImagePart]:
        return [img for m in self.messages for img in m.images]


@dataclass(frozen=True)
class RequestLimits:
    max_tokens: int = 1024
    max_images: int = 4


MAX_SEED = 2**63 - 1          # a 64-bit signed seed: what torch's generators and other servers accept
MIN_SEED = -(2**63)


# ---------------------------------------------------------------- the wire models (pydantic, OpenAPI)

class _Wire(BaseModel):
    """Strict: a JSON number is not a string, `true` is not 1, a float is not an integer."""
    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)


class TextPart(_Wire):
    type: Literal["text"]
    text: str


class ImageUrl(_Wire):
    url: str = Field(description="a base64 data URL: data:image/png;base64,... (remote URLs are never fetched)")
    detail: str | None = None


class ImageUrlPart(_Wire):
    type: Literal["image_url"]
    image_url: ImageUrl | str


ContentPart = Annotated[Union[TextPart, ImageUrlPart], Field(discriminator="type")]


class ChatMessage(_Wire):
    role: Literal["system", "user", "assistant"]
    content: str | list[ContentPart]


class JsonSchemaFormat(_Wire):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema", description="a JSON Schema the answer must match")
    strict: bool | None = None


class ResponseFormat(_Wire):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Wire):
    include_usage: bool = False


class DeskEyeExtension(_Wire):
    """DeskEye's own request facts (e.g. the window the frame came from); other servers ignore the field."""


class ChatCompletionRequest(_Wire):
    """POST /v1/chat/completions: the subset of OpenAI's request this worker honours (other fields are ignored)."""
    model: str = ""
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, description="0 = off")
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    n: int | None = Field(None, ge=1, le=1, description="one choice per request")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    deskeye: DeskEyeExtension | None = None


def parse_chat_request(body: Any, limits: RequestLimits = RequestLimits()) -> ChatRequest:
    """Validate a decoded JSON body of POST /v1/chat/completions. Raises ProtocolError."""
    try:
        raw = json.dumps(body).encode("utf-8")
    except (TypeError, ValueError, RecursionError):
        raise ProtocolError("The request body must be a JSON object.") from None
    return parse_chat_json(raw, limits)


def parse_chat_json(raw: bytes, limits: RequestLimits = RequestLimits()) -> ChatRequest:
    """Validate the raw JSON body of POST /v1/chat/completions (parsing and validation in one pass: pydantic's
    parser also bounds the nesting depth). Raises ProtocolError naming the field and what it accepts."""
    try:
        wire = ChatCompletionRequest.model_validate_json(raw)
    except ValidationError as exc:
        raise protocol_error_from(exc) from None
    return chat_request_from(wire, limits)


def chat_request_from(wire: ChatCompletionRequest, limits: RequestLimits) -> ChatRequest:
    request = ChatRequest(
        model=wire.model,
        messages=tuple(_message(m, f"messages[{i}]") for i, m in enumerate(wire.messages)),
        sampling=_sampling(wire, limits),
        stream=bool(wire.stream),
        include_usage=bool(wire.stream_options and wire.stream_options.include_usage),
        deskeye=wire.deskeye.model_dump() if wire.deskeye is not None else None,
        **_response_format(wire.response_format),
    )
    if len(request.images) > limits.max_images:
        raise ProtocolError(f"At most {limits.max_images} images per request; got {len(request.images)}.",
                            param="messages", status=413)
    return request


def protocol_error_from(exc: ValidationError) -> ProtocolError:
    """pydantic's errors -> one ProtocolError: the most specific error, its field path (messages[0].role), the
    rule it broke and the value that broke it."""
    errors = exc.errors(include_url=False)
    error = max(errors, key=lambda e: len(e["loc"]))
    if error["type"] == "json_invalid":
        reason = str((error.get("ctx") or {}).get("error", error["msg"]))
        if "recursion limit" in reason:
            return ProtocolError(f"The request body is nested too deeply ({reason}); send a flatter document.",
                                 code="invalid_json")
        return ProtocolError(f"The request body is not valid JSON ({reason}).", code="invalid_json")
    path = _path(error["loc"])
    if not path:
        return ProtocolError("The request body must be a JSON object.")
    got = error.get("input")
    shown = "" if error["type"] == "missing" else f"; got {_short_repr(got)}"
    return ProtocolError(f"{path}: {error['msg']}{shown}.", param=path)


def _path(loc: tuple) -> str:
    """('messages', 0, 'content', 'list[tagged-union[...]]', 1, 'text') -> 'messages[0].content[1].text'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and part not in ("str", "int", "float", "bool", "list", "dict") \
                or part == "schema":
            out += f".{part}" if out else part
    return out


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _message(wire: ChatMessage, where: str) -> Message:
    if isinstance(wire.content, str):
        return Message(wire.role, (wire.content,))
    return Message(wire.role, tuple(_part(p, f"{where}.content[{j}]") for j, p in enumerate(wire.content)))


def _part(wire: TextPart | ImageUrlPart, where: str) -> str | ImagePart:
    if isinstance(wire, TextPart):
        return wire.text
    url = wire.image_url.url if isinstance(wire.image_url, ImageUrl) else wire.image_url
    return decode_data_url(url, where)


_DATA_URL = re.compile(r"^data:(?P<mime>[\w/+.-]+)?(;[\w=-]+)*;base64,(?P<data>.*)$", re.S)


def decode_data_url(url: str, where: str = "image_url") -> ImagePart:
    match = _DATA_URL.match(url)
    if not match:
        raise ProtocolError(f"{where}: only base64 data URLs are accepted (data:image/png;base64,...); "
                            "the worker never fetches remote URLs.", param=where)
    mime = (match.group("mime") or "").lower()
    if mime not in SUPPORTED_IMAGE_MIME:
        raise ProtocolError(f"{where}: unsupported image type {mime!r}; use one of {', '.join(SUPPORTED_IMAGE_MIME)}.",
                            param=where, status=415)
    try:
        data = base64.b64decode(match.group("data"), validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError(f"{where}: the base64 payload is broken.", param=where) from None
    if not data:
        raise ProtocolError(f"{where}: the image is empty.", param=where)
    return ImagePart(data, mime)


def _sampling(wire: ChatCompletionRequest, limits: RequestLimits) -> SamplingParams:
    max_tokens = wire.max_tokens or wire.max_completion_tokens or min(DEFAULT_MAX_TOKENS, limits.max_tokens)
    if max_tokens > limits.max_tokens:
        raise ProtocolError(f"'max_tokens' is {max_tokens}; this worker allows at most {limits.max_tokens} "
                            "(start it with a larger --max-tokens-limit to change that).", param="max_tokens")
    return SamplingParams(max_tokens=max_tokens,
                          temperature=0.0 if wire.temperature is None else float(wire.temperature),
                          top_p=1.0 if wire.top_p is None else float(wire.top_p),
                          top_k=wire.top_k or 0, seed=wire.seed)


def _response_format(wire: ResponseFormat | None) -> dict[str, Any]:
    if wire is None or wire.type == "text":
        return {}
    if wire.type == "json_object":
        return {"json_schema": JSON_OBJECT_SCHEMA, "schema_name": "json_object"}
    if wire.json_schema is None:
        raise ProtocolError("response_format.json_schema.schema must be a JSON Schema object.",
                            param="response_format")
    return {"json_schema": wire.json_schema.schema_, "schema_name": wire.json_schema.name or "schema"}

# ---------------------------------------------------------------- responses (worker side)

@dataclass
class Completion:
    """What one request produced, before it is wrapped in the OpenAI envelope."""
    text: str
    finish_reason: str            # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    retries: int = 0              # constrained-output retries it took
    extra: dict[str, Any] = field(default_factory=dict)   # engine facts (cache hits, ocr timings, …)


def completion_body(completion: Completion, *, request_id: str, model: str, created: int) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": completion.text},
            "finish_reason": completion.finish_reason,
        }],
        "usage": usage_body(completion),
        "deskeye": {"retries": completion.retries, **completion.extra},
    }


# ---------------------------------------------------------------- response models (OpenAPI)

class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Out):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorBody(_Out):
    """Every error the worker answers: `{"error": {...}}`, OpenAI's shape."""
    error: ErrorDetail


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
    deskeye: dict[str, Any] | None = None


class ChunkDelta(_Out):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(_Out):
    index: int
    delta: ChunkDelta
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(_Out):
    """One Server-Sent Event of a streamed answer (`data: {...}`); the stream ends with `data: [DONE]`."""
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class ModelCard(_Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(_Out):
    object: Literal["list"]
    data: list[ModelCard]


class Health(_Out):
    status: str
    engine: str | None = None
    model: str | None = None
    progress: str | None = None
    error: str | None = None


def chunk_body(*, request_id: str, model: str, created: int, delta: dict[str, Any] | None,
               finish_reason: str | None = None, usage: dict[str, int] | None = None,
               extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """One chat.completion.chunk; `delta=None` is the usage-only last chunk (no choices), as OpenAI sends it."""
    body: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                            "model": model,
                            "choices": [] if delta is None else [{"index": 0, "delta": delta,
                                                                  "finish_reason": finish_reason}]}
    if usage is not None:
        body["usage"] = usage
    if extra:
        body["deskeye"] = extra
    return body


def usage_body(completion: Completion) -> dict[str, int]:
    return {"prompt_tokens": completion.prompt_tokens, "completion_tokens": completion.completion_tokens,
            "total_tokens": completion.prompt_tokens + completion.completion_tokens}


# ---------------------------------------------------------------- app side

@dataclass(frozen=True)
class Turn:
    question: str
    answer: str


@dataclass(frozen=True)
class Description:
    summary: str
    key_objects: list[str]


SYSTEM_PROMPT = (
    "You are DeskEye, a private desktop assistant. You see a region of the user's screen. "
    "Answer in JSON with a short 'summary' of what is on the screen (or the answer to the question) "
    "and 'key_objects': the few things on screen that matter."
)
DESCRIBE_QUESTION = "What is on this screen?"


def image_data_url(png: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(png).decode('ascii')}"


def build_messages(question: str, image_png: bytes | None, memory: list[Turn] = (),
                   context: str | None = None) -> list[dict[str, Any]]:
    """OpenAI-format messages: system prompt, previous turns, then the question with the frame."""
    system = SYSTEM_PROMPT if not context else f"{SYSTEM_PROMPT}\nText read on the screen:\n{context}"
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for turn in memory:
        messages.append({"role": "user", "content": turn.question})
        messages.append({"role": "assistant", "content": turn.answer})
    content: list[dict[str, Any]] = []
    if image_png is not None:
        content.append({"type": "image_url", "image_url": {"url": image_data_url(image_png)}})
    content.append({"type": "text", "text": question})
    messages.append({"role": "user", "content": content})
    return messages


def deskeye_response_format() -> dict[str, Any]:
    return {"type": "json_schema",
            "json_schema": {"name": DESKEYE_SCHEMA_NAME, "schema": DESKEYE_SCHEMA, "strict": True}}


def parse_description(content: str) -> Description:
    """Read an answer in DeskEye's schema. Raises ValueError naming what was wrong."""
    try:
        data = json.loads(content)
    except json.JSONDecodeError as exc:
        raise ValueError(f"The model's answer is not JSON ({exc.msg} at char {exc.pos}).") from None
    if not isinstance(data, dict) or not isinstance(data.get("summary"), str):
        raise ValueError("The model's answer has no 'summary' string.")
    objects = data.get("key_objects", [])
    if not isinstance(objects, list) or not all(isinstance(o, str) for o in objects):
        raise ValueError("The model's answer has 'key_objects' that is not a list of strings.")
    return Description(data["summary"], objects)
