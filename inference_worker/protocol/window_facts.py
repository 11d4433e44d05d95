"""DeskEye's request extension: the windows of the captured frame, and the user's language.

The app knows which windows are in the captured region (X11: stacking order, geometry, title, WM_CLASS)
and sends them beside the frame, in the request body:

  "deskeye": {"windows": [{"title": "Save failed", "app": "zenity Zenity", "box": [l, t, r, b],
                           "frame": [l, t, r, b], "focused": true}, ...]}

`windows` lists the visible windows front first (index 0 is on top). `box` is the window's client area and
`frame` the same window with its window-manager decorations (title bar, borders; = box without a window
manager), both in pixels of the captured region (right/bottom exclusive; they may reach past the region).
`focused` marks the window with the keyboard focus. `"language": "en" | "zh_CN" | "zh_TW"` (optional) is the
language the user reads: the OCR engine writes its framing ("About …", the kind of window) in it. Any other key
is ignored; bounds are checked (at most MAX_WINDOW_FACTS windows, strings cut to WINDOW_TEXT_MAX_CHARS,
coordinates within +-MAX_WINDOW_COORD).
Without the field (describe --image, other clients) the OCR engine works from pixels alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from inference_worker.errors import ProtocolError

#: the languages DeskEye speaks (deskeye/language.py), as the "deskeye" field's "language" names them
ANSWER_LANGUAGES = ("en", "zh_CN", "zh_TW")
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


def parse_answer_language(raw: Any) -> str | None:
    """The "deskeye" field's "language": the language the user reads, which the OCR engine writes its framing in;
    None when absent (the engine then goes by the question). Raises ProtocolError for any other value."""
    language = raw.get("language") if isinstance(raw, dict) else None
    if language is None or language in ANSWER_LANGUAGES:
        return language
    raise ProtocolError(f"deskeye.language must be one of {', '.join(ANSWER_LANGUAGES)}; got {language!r}.",
                        param="deskeye.language")


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
