"""Which window each line of text belongs to, and which window is in front.

With window facts (the request's "deskeye": {"windows": [...]}, front first) the windows are known: each line
goes to the frontmost window whose frame holds it; lines in a window's decorations (title bar, its _ □ ×
buttons) are dropped, since the title comes from the facts. Without facts the windows are found in the
pixels: a title bar is a short band of one colour per row (a gradient at most), wider than the title on it,
set off from what is above and below by a sharp edge, with a straight side edge under its ends. A window
nested inside another's rectangle is in front of it; between others the more colourful title bar (the active
one, in nearly every theme) is in front. Lines in no window form a last view with no title.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from inference_worker.engines.ocr.reader import OcrLine, Rect
from inference_worker.protocol import WindowFact

#: colour steps (0-255, any channel) that count as an edge between two areas
EDGE_STEP = 24
#: colours closer than this count as the same (a gradient, antialiasing)
SAME_COLOUR = 12
MIN_BAR_WIDTH_PX = 120
MAX_BAR_HEIGHT_PX = 48
BOX_OVERRUN_PX = 8            # how much taller than its bar a title's box may be (a CJK title's overruns ~4 px a side)
MAX_BAR_GAP_PX = 48           # buttons and icons interrupt a title bar for at most this long
SIDE_EDGE_PX = 24             # rows under a title bar's end that must continue its side edge
END_ZONE_PX = 64              # where a title bar's buttons or icon sit, from either end


@dataclass
class WindowView:
    """One window as the engine tells it: its area in the frame, its title, its lines (reading order)."""
    box: Rect                          # content area (client area; below the title bar when found in pixels)
    title: str | None
    app: str = ""
    lines: list[OcrLine] = field(default_factory=list)
    is_foreground: bool = False
    source: str = "pixels"             # "facts", "pixels", or "screen" (no window found)
    bar_chroma: float = 0.0
    covered: tuple[Rect, ...] = ()     # the frames of windows in front of it: what shows there is theirs

    def is_covered(self, x: float, y: float) -> bool:
        """Whether a window in front shows at (x, y): the pixels there say nothing about this window."""
        return any(_holds(rect, (x, y)) for rect in self.covered)

    @property
    def width(self) -> int:
        return self.box[2] - self.box[0]

    @property
    def height(self) -> int:
        return self.box[3] - self.box[1]


def segment(lines: Sequence[OcrLine], bgr: np.ndarray, facts: Sequence[WindowFact] = ()) -> list[WindowView]:
    """The windows with their lines, the foreground window first, then the others front to back, then the
    lines outside every window (title None)."""
    if facts:
        return _from_facts(lines, bgr, facts)
    return _from_pixels(lines, bgr)


# -------------------------------------------------------------------- with facts

def _from_facts(lines: Sequence[OcrLine], bgr: np.ndarray, facts: Sequence[WindowFact]) -> list[WindowView]:
    height, width = bgr.shape[:2]
    frames = [_clip(f.frame, width, height) for f in facts]
    views = [WindowView(_clip(f.box, width, height), f.title or None, f.app, source="facts", is_foreground=f.focused,
                        covered=_in_front(frames[:i], _clip(f.box, width, height))) for i, f in enumerate(facts)]
    rest: list[OcrLine] = []
    for line in lines:
        owner = next((i for i, frame in enumerate(frames) if _holds(frame, line.center)), None)
        if owner is None:
            rest.append(line)
        elif _holds(views[owner].box, line.center):
            views[owner].lines.append(line)
        # else: the window's decorations (title bar, buttons): its title is in the facts
    if not any(v.is_foreground for v in views):
        views[0].is_foreground = True
    views.sort(key=lambda v: not v.is_foreground)           # stable: the rest stay front to back
    return _with_rest(views, rest, width, height)


# -------------------------------------------------------------------- from pixels

@dataclass(frozen=True)
class TitleBar:
    rect: Rect                # the bar
    window: Rect              # the bar and the window under it
    title: OcrLine
    chroma: float


def _from_pixels(lines: Sequence[OcrLine], bgr: np.ndarray) -> list[WindowView]:
    height, width = bgr.shape[:2]
    bars = find_title_bars(lines, bgr)
    if not bars:
        return [WindowView((0, 0, width, height), None, lines=list(lines), source="screen")]
    bars.sort(key=lambda b: (-round(b.chroma / 24), -_nesting_depth(b, bars)))
    views = [WindowView((b.window[0], b.rect[3], b.window[2], b.window[3]), b.title.text, bar_chroma=b.chroma,
                        covered=_in_front([front.window for front in bars[:i]], b.window)) for i, b in enumerate(bars)]
    rest: list[OcrLine] = []
    for line in lines:
        owner = next((i for i, b in enumerate(bars) if _holds(b.window, line.center)), None)
        if owner is None:
            rest.append(line)
        elif _holds(views[owner].box, line.center):
            views[owner].lines.append(line)
    views[0].is_foreground = True
    return _with_rest(views, rest, width, height)


def find_title_bars(lines: Sequence[OcrLine], bgr: np.ndarray) -> list[TitleBar]:
    """Title bars in the frame, each with the line of text it carries and the window it tops. A bar carries
    one title: other text on it may only sit near its ends (buttons, an icon)."""
    bars: list[TitleBar] = []
    for line in lines:
        bar = _title_bar_of(line, bgr)
        if bar is None or any(_overlap(bar.rect, other.rect) for other in bars):
            continue
        others = [o for o in lines if o is not line and _holds(bar.rect, o.center)]
        if all(_near_bar_end(o, bar.rect) for o in others):
            bars.append(bar)
    return bars


def _near_bar_end(line: OcrLine, bar: Rect) -> bool:
    return line.box[2] <= bar[0] + MAX_BAR_GAP_PX + 16 or line.box[0] >= bar[2] - MAX_BAR_GAP_PX - 16


def _title_bar_of(line: OcrLine, bgr: np.ndarray) -> TitleBar | None:
    height, width = bgr.shape[:2]
    left, top, right, bottom = line.box
    if len(line.text.strip()) < 2 or bottom - top < 8:
        return None
    xl, xr = left - 6, right + 6
    if xl < 0 or xr >= width:
        return None
    y_center = (top + bottom) // 2
    first_top, first_bottom = _vertical_run(bgr, xl, y_center, -1), _vertical_run(bgr, xl, y_center, +1)
    if not (bottom - top) - BOX_OVERRUN_PX <= first_bottom - first_top <= MAX_BAR_HEIGHT_PX:
        return None                                  # checked first: most lines are not on a bar
    rows = slice(max(top + 3, first_top + 1), min(bottom - 3, first_bottom - 1))     # the box's rows on the bar
    if rows.stop - rows.start < 2:
        return None
    profile = bgr[rows, xl].astype(int)
    # the bar's colours continue right of the title, or the box took in the buttons and ends with the bar
    continues = min(_diff(profile, bgr[rows, x]) for x in range(right, min(width, right + 12))) <= SAME_COLOUR
    bar_left = _extent(bgr, rows, profile, xl, -1)
    bar_right = _extent(bgr, rows, profile, right, +1) if continues else _last_same(bgr, rows, profile, right)
    if bar_right - bar_left < max(MIN_BAR_WIDTH_PX, (right - left) + 40):
        return None
    runs = {(_vertical_run(bgr, x, y_center, -1), _vertical_run(bgr, x, y_center, +1))
            for x in ((xl, min(xr, bar_right - 3), bar_left + 2, bar_right - 3) if continues else (xl, bar_left + 2))}
    bar_top, bar_bottom = min(r[0] for r in runs), max(r[1] for r in runs)
    if max(r[0] for r in runs) - bar_top > 2 or bar_bottom - min(r[1] for r in runs) > 2:
        return None                                  # not one band across: text rows, cells, keys
    if not (bottom - top) - BOX_OVERRUN_PX <= bar_bottom - bar_top <= MAX_BAR_HEIGHT_PX or bar_bottom >= height:
        return None
    if not _has_side_edge(bgr, bar_left, bar_right, bar_bottom) or \
            not _has_end_marks(bgr, slice(bar_top + 2, bar_bottom - 2), bar_left, bar_right):
        return None
    window_bottom = _window_bottom(bgr, bar_left, bar_right, bar_bottom)
    colour = bgr[bar_top:bar_bottom, xl].astype(float).mean(axis=0)
    chroma = float(colour.max() - colour.min())
    return TitleBar((bar_left, bar_top, bar_right, bar_bottom), (bar_left, bar_top, bar_right, window_bottom),
                    line, chroma)


def _extent(bgr: np.ndarray, rows: slice, profile: np.ndarray, start: int, step: int) -> int:
    """How far the bar's per-row colours continue from `start` in direction `step` (gaps allowed)."""
    columns = bgr[rows, start + step::step] if step > 0 else bgr[rows, start - 1::-1] if start > 0 else bgr[rows, :0]
    same = np.abs(columns.astype(np.int16) - profile[:, None, :]).max(axis=(0, 2)) <= SAME_COLOUR
    hits = np.flatnonzero(same)
    if hits.size == 0 or hits[0] > MAX_BAR_GAP_PX:
        return start if step < 0 else start + 1
    gaps = np.flatnonzero(np.diff(hits) > MAX_BAR_GAP_PX + 1)
    reach = int(hits[gaps[0]] if gaps.size else hits[-1]) + 1
    return start - reach if step < 0 else start + reach + 1


def _last_same(bgr: np.ndarray, rows: slice, profile: np.ndarray, right: int) -> int:
    """Where the bar ends inside a box that overran it (the detector took the buttons and a few pixels past the
    window's edge into one box): one past the last column, within a button zone of `right`, in the bar's colours."""
    start = max(0, right - END_ZONE_PX)
    band = bgr[rows, start:right].astype(np.int16)
    same = np.flatnonzero(np.abs(band - profile[:, None, :]).max(axis=(0, 2)) <= SAME_COLOUR)
    return start + int(same[-1]) + 1 if same.size else right


def _vertical_run(bgr: np.ndarray, x: int, y: int, step: int) -> int:
    """From row `y` in column `x`, the first row past a sharp colour step (top: inclusive, bottom: exclusive);
    far outside the frame when there is none within a bar's height."""
    height = bgr.shape[0]
    if step < 0:
        column = bgr[max(0, y - MAX_BAR_HEIGHT_PX - 1):y + 1, x][::-1].astype(np.int16)
    else:
        column = bgr[y:min(height, y + MAX_BAR_HEIGHT_PX + 2), x].astype(np.int16)
    steps = np.flatnonzero(np.abs(np.diff(column, axis=0)).max(axis=1) > EDGE_STEP)
    if steps.size:
        return y - int(steps[0]) if step < 0 else y + int(steps[0]) + 1
    if column.shape[0] < MAX_BAR_HEIGHT_PX + 2:                    # the frame's edge came first
        return y - column.shape[0] + 1 if step < 0 else height
    return -10_000 if step < 0 else 10_000


def _has_side_edge(bgr: np.ndarray, bar_left: int, bar_right: int, bar_bottom: int) -> bool:
    """Under one end of the bar a straight edge continues down (the window's side), or the frame ends there."""
    height, width = bgr.shape[:2]
    rows = slice(bar_bottom + 2, min(height, bar_bottom + 2 + SIDE_EDGE_PX))
    if rows.stop - rows.start < 4:
        return False
    for outside, inside in ((bar_left - 1, bar_left + 2), (bar_right, bar_right - 3)):
        if outside < 0 or outside >= width:
            return True
        column = bgr[rows, outside].astype(int)
        straight = int(np.abs(column - column[0]).max()) <= SAME_COLOUR
        if straight and _diff(column, bgr[rows, inside]) > EDGE_STEP:
            return True
    return False


def _has_end_marks(bgr: np.ndarray, rows: slice, bar_left: int, bar_right: int) -> bool:
    """A title bar carries marks near an end (the window's buttons, its icon): a plain label does not."""
    if rows.stop - rows.start < 2:
        return False
    band = bgr[rows, bar_left:bar_right].astype(int)
    reference = np.median(band, axis=1, keepdims=True)
    marked = np.abs(band - reference).max(axis=2).max(axis=0) > EDGE_STEP
    zone = END_ZONE_PX
    return int(marked[:zone].sum()) >= 3 or int(marked[-zone:].sum()) >= 3


def _window_bottom(bgr: np.ndarray, bar_left: int, bar_right: int, bar_bottom: int) -> int:
    """Where the window's side edge ends (or the frame does): the longer straight edge under the bar's ends."""
    height, width = bgr.shape[:2]
    bottoms = []
    for outside in (bar_left - 1, bar_right):
        if not 0 <= outside < width:
            continue
        column = bgr[bar_bottom + 2:, outside].astype(int)
        moved = np.flatnonzero(np.abs(column - column[0]).max(axis=1) > SAME_COLOUR) if column.size else []
        bottoms.append(height if len(moved) == 0 else bar_bottom + 2 + int(moved[0]))
    return max(bottoms, default=height)


def _nesting_depth(bar: TitleBar, bars: Sequence[TitleBar]) -> int:
    return sum(1 for other in bars if other is not bar and _inside(bar.window, other.window))


# -------------------------------------------------------------------- geometry

def _with_rest(views: list[WindowView], rest: list[OcrLine], width: int, height: int) -> list[WindowView]:
    if rest:
        views.append(WindowView((0, 0, width, height), None, lines=rest, source="screen",
                                covered=tuple(v.box for v in views)))
    return views


def _in_front(fronts: Sequence[Rect], box: Rect) -> tuple[Rect, ...]:
    """The rectangles of the windows in front (`fronts`) that overlap `box`."""
    return tuple(front for front in fronts if _overlap(front, box))


def _diff(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(int) - b.astype(int)).max())


def _clip(rect: Sequence[int], width: int, height: int) -> Rect:
    return max(0, rect[0]), max(0, rect[1]), min(width, rect[2]), min(height, rect[3])


def _holds(rect: Rect, point: tuple[float, float]) -> bool:
    return rect[0] <= point[0] < rect[2] and rect[1] <= point[1] < rect[3]


def _overlap(a: Rect, b: Rect) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _inside(a: Rect, b: Rect) -> bool:
    return b[0] <= a[0] and b[1] <= a[1] and a[2] <= b[2] and a[3] <= b[3]
