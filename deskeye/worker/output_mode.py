"""How the client gets DeskEye's JSON out of a server: the schema-constrained path, and what to do when it fails.

Two output modes:
- `json_schema`: the request carries `response_format` json_schema; a server with structured output (DeskEye's
  worker, vLLM, SGLang, llama.cpp, Ollama) can only answer the schema's JSON, so its answer starts with `{`.
- `prompt_and_parse`: for a server that ignores `response_format` (e.g. `transformers serve`): the JSON is asked
  for in the prompt and read leniently out of whatever text comes back; one stricter retry; at the end, the
  model's plain text is the summary.

The plan for one question is a ladder of `Attempt`s: an answer cut off at the token limit is asked again with
twice the room (at most `MAX_ROOM_FACTOR` times the configured max_tokens, `MAX_ROOM_RETRIES` times); an answer
that is not JSON at all in json_schema mode means the server ignored the schema (`ignored_schema`). Pure
functions: no I/O, no regex on model text (it is untrusted and unbounded).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from deskeye.prompt import (MAX_KEY_OBJECTS, OBJECT_MAX_CHARS, SUMMARY_MAX_CHARS, Description, deskeye_response_format,
                            parse_description)

JSON_SCHEMA = "json_schema"
PROMPT_AND_PARSE = "prompt_and_parse"
OUTPUT_MODES = (JSON_SCHEMA, PROMPT_AND_PARSE)

MAX_ROOM_FACTOR = 4              # a cut-off answer may get up to 4x the configured max_tokens ...
MAX_ROOM_TOKENS = 4096           # ... and never more than this
MAX_ROOM_RETRIES = 2             # 256 -> 512 -> 1024
MAX_JSON_STARTS = 16             # '{' positions tried when digging a JSON object out of free text

JSON_INSTRUCTION = (
    "Reply with one JSON object and nothing else, exactly of this form: "
    '{"summary": "<at most %d characters>", "key_objects": ["<at most %d names, each at most %d characters>"]}.'
    % (SUMMARY_MAX_CHARS, MAX_KEY_OBJECTS, OBJECT_MAX_CHARS)
)
STRICT_JSON_INSTRUCTION = (
    "Your reply must be ONLY a JSON object: start with { and end with }, no code fence, no words before or "
    'after it. Keys: "summary" (a string) and "key_objects" (a list of strings). ' + JSON_INSTRUCTION
)


@dataclass(frozen=True)
class Attempt:
    mode: str                    # JSON_SCHEMA | PROMPT_AND_PARSE
    max_tokens: int
    is_strict: bool = False      # prompt_and_parse: the stricter prompt
    num_room_retries: int = 0

    def __post_init__(self):
        if self.mode not in OUTPUT_MODES:
            raise ValueError(f"output mode {self.mode!r}: expected one of {', '.join(OUTPUT_MODES)}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens {self.max_tokens}: expected >= 1")


@dataclass(frozen=True)
class Outcome:
    """What one answer means: a description (done), or the next attempt, or neither (give up)."""
    description: Description | None = None
    next_attempt: Attempt | None = None
    ignored_schema: bool = False         # json_schema mode got free text: the server ignores response_format
    is_plain_text: bool = False          # the description is the model's text, not JSON it wrote


def room_cap(configured_max_tokens: int) -> int:
    return max(configured_max_tokens, min(configured_max_tokens * MAX_ROOM_FACTOR, MAX_ROOM_TOKENS))


def request_fields(attempt: Attempt, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat-completions fields that depend on the attempt: messages, response_format, max_tokens."""
    if attempt.mode == JSON_SCHEMA:
        return dict(messages=messages, response_format=deskeye_response_format(), max_tokens=attempt.max_tokens)
    instruction = STRICT_JSON_INSTRUCTION if attempt.is_strict else JSON_INSTRUCTION
    return dict(messages=with_instruction(messages, instruction), max_tokens=attempt.max_tokens)


def with_instruction(messages: list[dict[str, Any]], instruction: str) -> list[dict[str, Any]]:
    """The messages with `instruction` appended to the system prompt (or a system message put first)."""
    if messages and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
        first = {**messages[0], "content": f"{messages[0]['content']}\n{instruction}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": instruction}, *messages]


def judge(attempt: Attempt, content: str, finish_reason: str | None, configured_max_tokens: int) -> Outcome:
    """Read one answer given the attempt that produced it."""
    if attempt.mode == JSON_SCHEMA:
        return _judge_schema_answer(attempt, content, finish_reason, configured_max_tokens)
    return _judge_prompted_answer(attempt, content, finish_reason, configured_max_tokens)


def _judge_schema_answer(attempt: Attempt, content: str, finish_reason: str | None,
                         configured_max_tokens: int) -> Outcome:
    try:
        return Outcome(description=parse_description(content))
    except ValueError:
        pass
    if not content.lstrip().startswith("{"):          # a schema-constrained answer always opens the object
        return Outcome(next_attempt=Attempt(PROMPT_AND_PARSE, attempt.max_tokens), ignored_schema=True)
    return Outcome(next_attempt=_more_room(attempt, finish_reason, configured_max_tokens))


def _judge_prompted_answer(attempt: Attempt, content: str, finish_reason: str | None,
                           configured_max_tokens: int) -> Outcome:
    description = lenient_description(content)
    if description is not None:
        return Outcome(description=description)
    if "{" in content and (roomier := _more_room(attempt, finish_reason, configured_max_tokens)) is not None:
        return Outcome(next_attempt=roomier)          # JSON was started and cut off: more room first
    if not attempt.is_strict:
        return Outcome(next_attempt=replace(attempt, is_strict=True))
    text = plain_text_summary(content)
    return Outcome(description=Description(text, []), is_plain_text=True) if text else Outcome()


def _more_room(attempt: Attempt, finish_reason: str | None, configured_max_tokens: int) -> Attempt | None:
    """The same attempt with twice the tokens, when the answer was cut off and the bounds allow it."""
    cap = room_cap(configured_max_tokens)
    if finish_reason != "length" or attempt.max_tokens >= cap or attempt.num_room_retries >= MAX_ROOM_RETRIES:
        return None
    return replace(attempt, max_tokens=min(attempt.max_tokens * 2, cap),
                   num_room_retries=attempt.num_room_retries + 1)


def lenient_description(content: str) -> Description | None:
    """The first JSON object in `content` with a string 'summary' (code fences and words around it allowed),
    cut to DeskEye's bounds; None when there is none."""
    decoder = json.JSONDecoder()
    start = content.find("{")
    for _ in range(MAX_JSON_STARTS):
        if start < 0:
            return None
        try:
            data, _end = decoder.raw_decode(content, start)
        except ValueError:
            data = None
        description = _bounded_description(data)
        if description is not None:
            return description
        start = content.find("{", start + 1)
    return None


def _bounded_description(data: Any) -> Description | None:
    if not isinstance(data, dict) or not isinstance(data.get("summary"), str):
        return None
    objects = data.get("key_objects")
    names = [o for o in objects if isinstance(o, str) and o.strip()] if isinstance(objects, list) else []
    return Description(_clean(data["summary"], SUMMARY_MAX_CHARS),
                       [_clean(name, OBJECT_MAX_CHARS) for name in names[:MAX_KEY_OBJECTS]])


def plain_text_summary(content: str) -> str:
    """A model's free-text answer as a summary: control characters as spaces, cut to SUMMARY_MAX_CHARS."""
    return _clean(content, SUMMARY_MAX_CHARS)


def _clean(text: str, max_chars: int) -> str:
    printable = "".join(" " if ord(ch) < 0x20 or 0x7f <= ord(ch) <= 0x9f else ch for ch in text)
    return " ".join(printable.split())[:max_chars]
