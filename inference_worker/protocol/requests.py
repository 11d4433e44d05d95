"""The requests the worker accepts: OpenAI's chat-completions request, the subset this worker honours.

The wire models (pydantic, strict) describe the body and serve the OpenAPI description at /openapi.json;
`parse_chat_json` validates a body in one pass and turns it into the worker's own frozen `ChatRequest`, raising a
ProtocolError that names the field, the rule it broke and the value that broke it.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from inference_worker.errors import ProtocolError
from inference_worker.protocol.window_facts import WindowFact, parse_answer_language, parse_window_facts

JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}
DEFAULT_MAX_TOKENS = 256
SUPPORTED_IMAGE_MIME = ("image/png", "image/jpeg", "image/webp", "image/bmp", "image/gif")


# ---------------------------------------------------------------- the worker's request

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
    windows: tuple[WindowFact, ...] = ()      # the request's "deskeye": {"windows": [...]}, front first
    language: str | None = None               # "deskeye": {"language": "en" | "zh_CN" | "zh_TW"}; None = not sent

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
    front first, each {"title", "app", "box": [l, t, r, b], "frame": [l, t, r, b], "focused"} (see WindowFact).
    `language`: the language the user reads, "en", "zh_CN" or "zh_TW" (the OCR engine writes its framing in it)."""
    windows: list[Any] | None = None
    language: Any | None = None


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
    deskeye = wire.deskeye.model_dump() if wire.deskeye is not None else None
    request = ChatRequest(
        model=wire.model,
        messages=tuple(_message(m, f"messages[{i}]") for i, m in enumerate(wire.messages)),
        sampling=_sampling(wire, limits),
        stream=bool(wire.stream),
        include_usage=bool(wire.stream_options and wire.stream_options.include_usage),
        windows=parse_window_facts(deskeye),
        language=parse_answer_language(deskeye),
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
