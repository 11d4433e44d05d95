"""Window facts: which windows are in the captured region, front first, with their titles, classes and geometry.

Read from the X server with python-xlib (the source `privacy.py` reads): the stacking order from the window
manager's `_NET_CLIENT_LIST_STACKING` (else the root's children, bottom to top, mapped only), each window's
`_NET_WM_NAME` (else WM_NAME), WM_CLASS, its client area and its frame (the window manager's decorations:
the top-level ancestor under the root) translated into the region's pixels. DeskEye's own windows (the
overlay and the Ask box: WM_CLASS or title "DeskEye ...") are left out. They travel with the frame as the
request's "deskeye" field (the wire format is documented, and checked, in `inference_worker.protocol`); the OCR
engine then tells the
foreground window first, with its real title. Anywhere else (no X, Wayland, macOS) there are no facts:
the engine works from pixels.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

from deskeye.x11_windows import window_title

log = logging.getLogger(__name__)

MAX_WINDOW_FACTS = 32                     # the most the worker accepts in one request

OWN_WINDOW_CLASS = "deskeye"              # Tk className of the overlay and Ask box (WM_CLASS, case-folded)
OWN_TITLE_PREFIX = "deskeye"              # their titles: "DeskEye overlay", "DeskEye - ask"
MIN_VISIBLE_PX = 4                        # a window showing less than this in both directions is not "in" it


@dataclass(frozen=True)
class WindowFact:
    """One visible window, as the request's "deskeye": {"windows": [...]} carries it."""
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


@dataclass(frozen=True)
class Region:
    """The captured rectangle in absolute screen pixels."""
    left: int
    top: int
    width: int
    height: int


def windows_in_region(region: Region, display_name: str | None = None) -> list[WindowFact]:
    """The windows that show in `region`, front first; [] when they cannot be known (no X display, an X error)."""
    if not sys.platform.startswith("linux") or not (display_name or os.environ.get("DISPLAY")):
        return []
    try:
        from Xlib import display
    except ImportError:
        return []
    try:
        conn = display.Display(display_name)
    except Exception as exc:  # noqa: BLE001 - no X server: no facts this time
        log.debug("Cannot open the X display for window facts: %s", exc)
        return []
    try:
        return _facts(conn, region)
    except Exception as exc:  # noqa: BLE001 - a window vanished mid-query, a broken property: no facts
        log.debug("Cannot read window facts: %s", exc)
        return []
    finally:
        conn.close()


def _facts(conn, region: Region) -> list[WindowFact]:
    from Xlib import X

    root = conn.screen().root
    focused = _focused_id(conn, root, X)
    facts = []
    for window in reversed(_stacking_bottom_to_top(conn, root, X)):       # front first
        fact = _fact(conn, root, window, region, focused)
        if fact is not None and not is_own_window(fact):
            facts.append(fact)
        if len(facts) == MAX_WINDOW_FACTS:
            break
    return _visible(facts, region)


def is_own_window(fact: WindowFact) -> bool:
    """DeskEye's overlay and Ask box: never described as part of the user's screen."""
    return (OWN_WINDOW_CLASS in fact.app.casefold().split()
            or fact.title.casefold().startswith(OWN_TITLE_PREFIX))


def _stacking_bottom_to_top(conn, root, X) -> list:
    prop = root.get_full_property(conn.intern_atom("_NET_CLIENT_LIST_STACKING"), X.AnyPropertyType)
    if prop is not None and len(prop.value):
        return [conn.create_resource_object("window", int(wid)) for wid in prop.value]
    mapped = []
    for child in root.query_tree().children:                # no window manager: the root's children
        attributes = child.get_attributes()
        if attributes.map_state == X.IsViewable and not attributes.override_redirect:
            mapped.append(child)
    return mapped


def _focused_id(conn, root, X) -> int | None:
    prop = root.get_full_property(conn.intern_atom("_NET_ACTIVE_WINDOW"), X.AnyPropertyType)
    if prop is not None and len(prop.value) and prop.value[0]:
        return int(prop.value[0])
    focus = conn.get_input_focus().focus
    return None if isinstance(focus, int) else focus.id


def _fact(conn, root, window, region: Region, focused: int | None) -> WindowFact | None:
    geometry = window.get_geometry()
    origin = window.translate_coords(root, 0, 0)
    left, top = -origin.x - region.left, -origin.y - region.top
    box = (left, top, left + geometry.width, top + geometry.height)
    frame = _frame_box(conn, root, window, region) or box
    if not _shows_in(frame, region):
        return None
    title = window_title(conn, window)
    app = " ".join(window.get_wm_class() or ())
    return WindowFact(title[:200], app[:200], box, frame, window.id == focused)


def _frame_box(conn, root, window, region: Region) -> tuple[int, int, int, int] | None:
    """The top-level ancestor under the root (a reparenting window manager's frame), in region pixels."""
    current = window
    for _ in range(16):
        parent = current.query_tree().parent
        if not parent or isinstance(parent, int) or parent.id == root.id:
            break
        current = parent
    if current.id == window.id:
        return None
    geometry = current.get_geometry()
    return (geometry.x - region.left, geometry.y - region.top,
            geometry.x - region.left + geometry.width + 2 * geometry.border_width,
            geometry.y - region.top + geometry.height + 2 * geometry.border_width)


def _shows_in(box: tuple[int, int, int, int], region: Region) -> bool:
    return (min(box[2], region.width) - max(box[0], 0) >= MIN_VISIBLE_PX
            and min(box[3], region.height) - max(box[1], 0) >= MIN_VISIBLE_PX)


def _visible(facts: list[WindowFact], region: Region) -> list[WindowFact]:
    """Drop windows whose part in the region is hidden behind one window in front (front first in and out)."""
    kept: list[WindowFact] = []
    for fact in facts:
        if not any(_covers(_clip(front.frame, region), _clip(fact.frame, region)) for front in kept):
            kept.append(fact)
    return kept


def _covers(front: tuple[int, int, int, int], back: tuple[int, int, int, int]) -> bool:
    return front[0] <= back[0] and front[1] <= back[1] and front[2] >= back[2] and front[3] >= back[3]


def _clip(box: tuple[int, int, int, int], region: Region) -> tuple[int, int, int, int]:
    return max(box[0], 0), max(box[1], 0), min(box[2], region.width), min(box[3], region.height)
