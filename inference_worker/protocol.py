"""What crosses the process boundary between the DeskEye app and the inference worker.

The wire format is OpenAI chat completions (so any OpenAI-compatible server can stand in for our
worker), plus DeskEye's response schema and the request's "deskeye" extension (window facts). This module is the
worker's side of it: requests are parsed with `parse_chat_request`; the app builds them with its own
`deskeye/prompt.py` and `deskeye/window_facts.py` (tests/test_prompt.py keeps the two sides agreeing). The request
subset the worker accepts is described by pydantic models (`ChatCompletionRequest`, also the OpenAPI description
at /openapi.json) and turned into the worker's own frozen `ChatRequest`. Pure Python: no torch, no PIL, no I/O.
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

# The bounds of DeskEye's answers (the app's schema, deskeye/prompt.py, asks for them; the OCR engine writes within
# them; tests/test_prompt.py keeps the two sides agreeing). The schema itself is the app's: the worker serves any.
SUMMARY_MAX_CHARS = 200
OBJECT_MAX_CHARS = 40
MAX_KEY_OBJECTS = 8
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
    windows: tuple["WindowFact", ...] = ()      # the request's "deskeye": {"windows": [...]}, front first

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
    """DeskEye's own request facts; other servers ignore the field. `windows`: the visible windows of the frame,
    front first, each {"title", "app", "box": [l, t, r, b], "frame": [l, t, r, b], "focused"} (see WindowFact)."""
    windows: list[Any] | None = None


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
        windows=parse_window_facts(wire.deskeye.model_dump() if wire.deskeye is not None else None),
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


#: a data URL's part before the comma (type, parameters, ";base64") is looked for only this far
MAX_DATA_URL_HEADER_CHARS = 1024


def decode_data_url(url: str, where: str = "image_url") -> ImagePart:
    """An image from a base64 data URL (RFC 2397): `data:<type>[;<attribute>=<value>]...;base64,<data>`. MIME
    parameters such as `name=a.png` or `charset=...` are allowed and ignored; the type is kept; base64 is required."""
    comma = url.find(",", 0, MAX_DATA_URL_HEADER_CHARS)
    fields = url[:comma].split(";") if comma > 0 else []
    if len(fields) < 2 or fields[0][:5].lower() != "data:" or fields[-1].strip().lower() != "base64":
        raise ProtocolError(f"{where}: only base64 data URLs are accepted (data:image/png;base64,...); "
                            "the worker never fetches remote URLs.", param=where)
    mime = fields[0][5:].strip().lower()
    if mime not in SUPPORTED_IMAGE_MIME:
        raise ProtocolError(f"{where}: unsupported image type {mime!r}; use one of {', '.join(SUPPORTED_IMAGE_MIME)}.",
                            param=where, status=415)
    try:
        data = base64.b64decode(url[comma + 1:], validate=True)
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

# ---------------------------------------------------------------- DeskEye extension: window facts
#
# The app knows which windows are in the captured region (X11: stacking order, geometry, title, WM_CLASS)
# and sends them beside the frame, in the request body:
#
#   "deskeye": {"windows": [{"title": "Save failed", "app": "zenity Zenity", "box": [l, t, r, b],
#                            "frame": [l, t, r, b], "focused": true}, ...]}
#
# `windows` lists the visible windows front first (index 0 is on top). `box` is the window's client area and
# `frame` the same window with its window-manager decorations (title bar, borders; = box without a window
# manager), both in pixels of the captured region (right/bottom exclusive; they may reach past the region).
# `focused` marks the window with the keyboard focus. Any other key is ignored; bounds are checked (at most
# MAX_WINDOW_FACTS windows, strings cut to WINDOW_TEXT_MAX_CHARS, coordinates within +-MAX_WINDOW_COORD).
# Without the field (describe --image, other clients) the OCR engine works from pixels alone.

MAX_WINDOW_FACTS = 32
WINDOW_TEXT_MAX_CHARS = 200
MAX_WINDOW_COORD = 65_536


@dataclass(frozen=True)
class WindowFact:
    title: str
    app: str                                 # WM_CLASS (instance and class, space-separated), "" when unknown
    box: tuple[int, int, int, int]           # client area: left, top, right, bottom in region pixels
    frame: tuple[int, int, int, int]         # with decorations; equal to box when there are none
    focused: bool = False

    def to_wire(self) -> dict[str, Any]:
        return {"title": self.title, "app": self.app, "box": list(self.box), "frame": list(self.frame),
                "focused": self.focused}


def parse_window_facts(raw: Any) -> tuple[WindowFact, ...]:
    """The "deskeye" field's windows, validated; () when the field is absent. Raises ProtocolError naming
    the bad entry."""
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise ProtocolError("'deskeye' must be an object such as {\"windows\": [...]}.", param="deskeye")
    windows = raw.get("windows")
    if windows is None:
        return ()
    if not isinstance(windows, list):
        raise ProtocolError("deskeye.windows must be a list of window objects.", param="deskeye.windows")
    if len(windows) > MAX_WINDOW_FACTS:
        raise ProtocolError(f"deskeye.windows lists {len(windows)} windows; at most {MAX_WINDOW_FACTS} "
                            "(send the frontmost ones).", param="deskeye.windows")
    return tuple(_parse_window_fact(w, f"deskeye.windows[{i}]") for i, w in enumerate(windows))


def _parse_window_fact(raw: Any, where: str) -> WindowFact:
    if not isinstance(raw, dict):
        raise ProtocolError(f"{where} must be an object with 'title', 'app', 'box'.", param=where)
    title, app = (_fact_text(raw.get(key, ""), f"{where}.{key}") for key in ("title", "app"))
    box = _fact_rect(raw.get("box"), f"{where}.box")
    frame = box if raw.get("frame") is None else _fact_rect(raw["frame"], f"{where}.frame")
    focused = raw.get("focused", False)
    if not isinstance(focused, bool):
        raise ProtocolError(f"{where}.focused must be true or false.", param=where)
    return WindowFact(title, app, box, frame, focused)


def _fact_text(value: Any, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ProtocolError(f"{where} must be a string.", param=where)
    return re.sub(r"[\u0000-\u001f\u007f-\u009f]+", " ", value[:WINDOW_TEXT_MAX_CHARS]).strip()


def _fact_rect(value: Any, where: str) -> tuple[int, int, int, int]:
    if (not isinstance(value, list) or len(value) != 4
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
        raise ProtocolError(f"{where} must be [left, top, right, bottom], four integers.", param=where)
    if not all(-MAX_WINDOW_COORD <= v <= MAX_WINDOW_COORD for v in value) or value[2] <= value[0] \
            or value[3] <= value[1]:
        raise ProtocolError(f"{where} must have right > left and bottom > top, each within "
                            f"+-{MAX_WINDOW_COORD}; got {value}.", param=where)
    return tuple(value)


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
