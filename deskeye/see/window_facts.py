"""Window facts: the windows in the captured region, front first, as the request's "deskeye" field carries them.

`deskeye.see.x11_windows.windows_in_region` reads them from the X server; this module is what they are and how
they travel: their wire form (documented, and checked, in the worker's protocol), which windows are DeskEye's own
(the overlay and the Ask box: WM_CLASS or title "DeskEye ...", left out), and which are hidden behind a window in
front. With window facts the OCR engine tells the foreground window first, with its real title. Anywhere else
(no X, Wayland, macOS) there are no facts: the engine works from pixels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


def is_own_window(fact: WindowFact) -> bool:
    """DeskEye's overlay and Ask box: never described as part of the user's screen."""
    return (OWN_WINDOW_CLASS in fact.app.casefold().split()
            or fact.title.casefold().startswith(OWN_TITLE_PREFIX))


def shows_in(box: tuple[int, int, int, int], region: Region) -> bool:
    """At least MIN_VISIBLE_PX of `box` (region pixels) lies inside the region, in both directions."""
    return (min(box[2], region.width) - max(box[0], 0) >= MIN_VISIBLE_PX
            and min(box[3], region.height) - max(box[1], 0) >= MIN_VISIBLE_PX)


def visible(facts: list[WindowFact], region: Region) -> list[WindowFact]:
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
