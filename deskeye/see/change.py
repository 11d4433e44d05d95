"""Has the screen changed *meaningfully* since the last frame DeskEye described?

Frames are compared as 64x48 grey thumbnails (one cell ~ 12x12 px of an 800x600 region; a changed line of
text moves tens of cells by tens of grey levels, which an 8x8 perceptual hash does not see). A cell has
changed when its grey level moved by more than `capture.change_threshold`. Then:

- MAJOR: at least `capture.min_changed_percent` of the cells changed (default 0.8 %, ~25 cells: one
  changed line of text) -> described at once;
- MINOR: fewer cells changed (a ticking clock, a blinking cursor, a spinner) -> described only when the
  last description is `capture.small_change_interval_s` old (default 60 s; 0 = never on their own);
- NONE: no cell changed.

Always against the last *described* frame, so slow drift adds up. Hotkey describes ignore all this.
DeskEye's own windows are masked out of the frames (deskeye/see/capture.py); the cells under a mask of either
frame are left out of the comparison, so an overlay that comes or goes is no change. Cost ~1 ms per frame.

What DeskEye's own Ask box and menus cause is no change either: while one is open, and for `OWN_WINDOW_SETTLE_S`
after the last one closed, the detector is *held* (`own_window_opened` / `own_window_closed`, `is_held`): the
capture loop does not even grab, and no automatic describe starts. Focus moving to the Ask box repaints the watched
window (its title bar, its cursor); when the box closes the focus goes back and the window looks as it did, which
matches the last described frame again. Holding is simpler and surer than guessing which cells focus repainted.
"""

from __future__ import annotations

import enum
import math
import threading
import time
from typing import TYPE_CHECKING, Callable, Sequence

from PIL import Image, ImageChops, ImageDraw

from deskeye.see.geometry import Rect

if TYPE_CHECKING:
    from deskeye.settings import CaptureSettings

THUMBNAIL_SIZE = (64, 48)
NUM_CELLS = THUMBNAIL_SIZE[0] * THUMBNAIL_SIZE[1]
OWN_WINDOW_SETTLE_S = 2.0     # after DeskEye's last own window closed: the focus goes back, the window repaints


class Change(enum.StrEnum):
    NONE = "none"
    MINOR = "minor"
    MAJOR = "major"


def thumbnail(image: Image.Image) -> Image.Image:
    return image.convert("L").resize(THUMBNAIL_SIZE, Image.Resampling.BOX)


def max_difference(a: Image.Image, b: Image.Image) -> int:
    """Largest grey-level difference (0-255) between two thumbnails."""
    return ImageChops.difference(a, b).getextrema()[1]


def mask_cells(thumb: Image.Image, masks: Sequence[Rect], size: tuple[int, int]) -> Image.Image:
    """A copy of `thumb` with the cells touched by `masks` (pixel rectangles of a `size` frame) set to 0."""
    if not masks:
        return thumb
    thumb = thumb.copy()
    draw = ImageDraw.Draw(thumb)
    sx, sy = THUMBNAIL_SIZE[0] / size[0], THUMBNAIL_SIZE[1] / size[1]
    for m in masks:
        draw.rectangle((math.floor(m.left * sx), math.floor(m.top * sy),
                        math.ceil(m.right * sx) - 1, math.ceil(m.bottom * sy) - 1), fill=0)
    return thumb


def num_changed_cells(a: Image.Image, b: Image.Image, threshold: int) -> int:
    """Thumbnail cells whose grey level differs by more than `threshold`."""
    return ImageChops.difference(a, b).point(lambda v: 255 if v > threshold else 0).histogram()[255]


def min_changed_cells(min_changed_percent: float) -> int:
    """`capture.min_changed_percent` of the thumbnail's cells, at least one."""
    return max(1, round(NUM_CELLS * min_changed_percent / 100))


class ChangeDetector:
    """Compares frames against the last described one. Thread-safe (capture loop and job thread)."""

    def __init__(self, threshold: int, min_changed_percent: float = 0.8, small_change_interval_s: float = 60.0,
                 *, clock: Callable[[], float] = time.monotonic, own_window_settle_s: float = OWN_WINDOW_SETTLE_S):
        self.threshold = threshold       # a cell difference above this counts as changed
        self.min_changed_cells = min_changed_cells(min_changed_percent)
        self.small_change_interval_s = small_change_interval_s
        self.own_window_settle_s = own_window_settle_s
        self._clock = clock
        self._described: Image.Image | None = None
        self._described_masks: tuple[Rect, ...] = ()
        self._described_at = 0.0
        self._num_own_open = 0           # DeskEye's own Ask box and menus open now
        self._held_until = 0.0           # ... and the settle time after the last one closed
        self._lock = threading.Lock()

    def apply(self, capture: CaptureSettings) -> None:
        """New thresholds while running (deskeye/live_settings.py); the last described frame stays the reference."""
        with self._lock:
            self.threshold = capture.change_threshold
            self.min_changed_cells = min_changed_cells(capture.min_changed_percent)
            self.small_change_interval_s = capture.small_change_interval_s

    def own_window_opened(self) -> None:
        """One of DeskEye's own windows (the Ask box, a menu) opened: hold until it closes and the screen settles."""
        with self._lock:
            self._num_own_open += 1

    def own_window_closed(self) -> None:
        with self._lock:
            self._num_own_open = max(0, self._num_own_open - 1)
            self._held_until = self._clock() + self.own_window_settle_s

    @property
    def is_held(self) -> bool:
        """An own window is open or closed less than `own_window_settle_s` ago: nothing is described on its own."""
        with self._lock:
            return self._num_own_open > 0 or self._clock() < self._held_until

    def classify(self, image: Image.Image, masks: Sequence[Rect] = ()) -> Change:
        """`masks`: rectangles of `image` (its own pixels) painted over DeskEye's windows."""
        thumb = thumbnail(image)
        with self._lock:
            if self._described is None:
                return Change.MAJOR
            both = (*masks, *self._described_masks)
            changed = num_changed_cells(mask_cells(thumb, both, image.size),
                                        mask_cells(self._described, both, image.size), self.threshold)
        if changed >= self.min_changed_cells:
            return Change.MAJOR
        return Change.MINOR if changed else Change.NONE

    def should_describe(self, image: Image.Image, masks: Sequence[Rect] = ()) -> bool:
        """Whether the capture loop should describe this frame (the rule in the module docstring)."""
        if self.is_held:
            return False
        change = self.classify(image, masks)
        if change is Change.MAJOR:
            return True
        if change is Change.MINOR and self.small_change_interval_s > 0:
            with self._lock:
                return self._clock() - self._described_at >= self.small_change_interval_s
        return False

    def is_changed(self, image: Image.Image, masks: Sequence[Rect] = ()) -> bool:
        return self.classify(image, masks) is not Change.NONE

    def mark_described(self, image: Image.Image, masks: Sequence[Rect] = ()) -> None:
        thumb = thumbnail(image)
        with self._lock:
            self._described = thumb
            self._described_masks = tuple(masks)
            self._described_at = self._clock()

    def reset(self) -> None:
        """Forget the reference: the next frame counts as changed."""
        with self._lock:
            self._described = None
