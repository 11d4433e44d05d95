"""What crosses the process boundary between the DeskEye app and the inference worker.

The wire format is OpenAI chat completions (so any OpenAI-compatible server can stand in for our
worker). This module is the single place that knows it: the worker parses requests with
`parse_chat_request`, the app builds them with `build_messages` and reads answers with
`parse_description`. Pure Python: no torch, no PIL, no I/O.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass, field
from typing import Any

# A string that always closes: no control characters, at most N characters. Grammar engines ignore
# maxLength when a pattern is set, so the bound lives in the pattern itself.
SUMMARY_MAX_CHARS = 200
OBJECT_MAX_CHARS = 40
MAX_KEY_OBJECTS = 8

DESKEYE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "summary": {"type": "string", "pattern": f"^[^\\u0000-\\u001f]{{0,{SUMMARY_MAX_CHARS}}}$"},
        "key_objects": {
            "type": "array",
            "items": {"type": "string", "pattern": f"^[^\\u0000-\\u001f]{{1,{OBJECT_MAX_CHARS}}}$"},
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


class ProtocolError(ValueError):
    """A request the worker cannot accept. `status` is the HTTP status, `param` names the field."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 code: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code

    def to_body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.code, "param": self.param, "code": self.status}}


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
    windows: tuple["WindowFact", ...] = ()      # the request's "deskeye": {"windows": [...]}, front first

    @property
    def images(self) -> list[ImagePart]:
        return [img for m in self.messages for img in m.images]


@dataclass(frozen=True)
class RequestLimits:
    max_tokens: int = 1024
    max_images: int = 4


def parse_chat_request(body: Any, limits: RequestLimits = RequestLimits()) -> ChatRequest:
    """Validate a decoded JSON body of POST /v1/chat/completions. Raises ProtocolError."""
    if not isinstance(body, dict):
        raise ProtocolError("The request body must be a JSON object.")
    model = body.get("model", "")
    if not isinstance(model, str):
        raise ProtocolError("'model' must be a string.", param="model")
    messages = _parse_messages(body.get("messages"))
    request = ChatRequest(
        model=model,
        messages=messages,
        sampling=_parse_sampling(body, limits),
        **_parse_response_format(body.get("response_format")),
        windows=parse_window_facts(body.get("deskeye")),
    )
    if len(request.images) > limits.max_images:
        raise ProtocolError(f"At most {limits.max_images} images per request; got {len(request.images)}.",
                            param="messages", status=413)
    return request


def _parse_messages(raw: Any) -> tuple[Message, ...]:
    if not isinstance(raw, list) or not raw:
        raise ProtocolError("'messages' must be a non-empty list.", param="messages")
    return tuple(_parse_message(m, i) for i, m in enumerate(raw))


def _parse_message(raw: Any, index: int) -> Message:
    where = f"messages[{index}]"
    if not isinstance(raw, dict):
        raise ProtocolError(f"{where} must be an object with 'role' and 'content'.", param=where)
    role = raw.get("role")
    if role not in ("system", "user", "assistant"):
        raise ProtocolError(f"{where}.role must be 'system', 'user' or 'assistant'; got {role!r}.", param=where)
    content = raw.get("content")
    if isinstance(content, str):
        return Message(role, (content,))
    if not isinstance(content, list):
        raise ProtocolError(f"{where}.content must be a string or a list of parts.", param=where)
    return Message(role, tuple(_parse_part(p, f"{where}.content[{j}]") for j, p in enumerate(content)))


def _parse_part(raw: Any, where: str) -> str | ImagePart:
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "text" and isinstance(raw.get("text"), str):
        return raw["text"]
    if kind == "image_url":
        url = raw.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str):
            raise ProtocolError(f"{where}.image_url.url must be a string.", param=where)
        return decode_data_url(url, where)
    raise ProtocolError(f"{where} must be {{'type': 'text', 'text': ...}} or "
                        f"{{'type': 'image_url', 'image_url': {{'url': 'data:image/png;base64,...'}}}}.", param=where)


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


def _parse_sampling(body: dict, limits: RequestLimits) -> SamplingParams:
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens", DEFAULT_MAX_TOKENS))
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ProtocolError("'max_tokens' must be a positive integer.", param="max_tokens")
    if max_tokens > limits.max_tokens:
        raise ProtocolError(f"'max_tokens' is {max_tokens}; this worker allows at most {limits.max_tokens} "
                            "(start it with a larger --max-tokens-limit to change that).", param="max_tokens")
    temperature = _number(body, "temperature", 0.0, lo=0.0, hi=2.0)
    top_p = _number(body, "top_p", 1.0, lo=0.0, hi=1.0)
    if top_p == 0.0:
        raise ProtocolError("'top_p' must be greater than 0.", param="top_p")
    top_k = body.get("top_k", 0)
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        raise ProtocolError("'top_k' must be a non-negative integer (0 = off).", param="top_k")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise ProtocolError("'seed' must be an integer.", param="seed")
    return SamplingParams(max_tokens, temperature, top_p, top_k, seed)


def _number(body: dict, key: str, default: float, *, lo: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not lo <= value <= hi:
        raise ProtocolError(f"'{key}' must be a number between {lo} and {hi}; got {value!r}.", param=key)
    return float(value)


def _parse_response_format(raw: Any) -> dict[str, Any]:
    if raw is None:
        return {}
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": JSON_OBJECT_SCHEMA, "schema_name": "json_object"}
    if kind == "json_schema":
        spec = raw.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ProtocolError("response_format.json_schema.schema must be a JSON Schema object.",
                                param="response_format")
        return {"json_schema": schema, "schema_name": spec.get("name") or "schema"}
    raise ProtocolError("response_format.type must be 'text', 'json_object' or 'json_schema'.",
                        param="response_format")


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


def deskeye_extension(windows: "list[WindowFact] | tuple[WindowFact, ...]") -> dict[str, Any]:
    """The request body's "deskeye" field for these window facts (front first)."""
    return {"windows": [w.to_wire() for w in list(windows)[:MAX_WINDOW_FACTS]]}


def parse_window_facts(raw: Any) -> tuple[WindowFact, ...]:
    """The "deskeye" field's windows, validated; () when the field is absent. Raises ProtocolError naming
    the bad entry."""
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise ProtocolError("'deskeye' must be an object such as {\"windows\": [...]}.", param="deskeye")
    windows = raw.get("windows", [])
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
        "usage": {
            "prompt_tokens": completion.prompt_tokens,
            "completion_tokens": completion.completion_tokens,
            "total_tokens": completion.prompt_tokens + completion.completion_tokens,
        },
        "deskeye": {"retries": completion.retries, **completion.extra},
    }


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
