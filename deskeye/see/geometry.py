"""Rectangles in absolute screen pixels (the desktop's, X11's): the one type capture, placement, masking and privacy
share; and where they lie in a capture backend's frames (`FrameMap`)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Rect:
    left: int
    top: int
    width: int
    height: int

    @property
    def right(self) -> int:
        return self.left + self.width

    @property
    def bottom(self) -> int:
        return self.top + self.height

    def as_mss(self) -> dict[str, int]:
        return {"left": self.left, "top": self.top, "width": self.width, "height": self.height}

    def intersects(self, other: "Rect") -> bool:
        return (self.left < other.right and other.left < self.right
                and self.top < other.bottom and other.top < self.bottom)

    def clip(self, other: "Rect") -> "Rect | None":
        """The part of `other` inside this rectangle, or None."""
        left, top = max(self.left, other.left), max(self.top, other.top)
        right, bottom = min(self.right, other.right), min(self.bottom, other.bottom)
        return Rect(left, top, right - left, bottom - top) if right > left and bottom > top else None


@dataclass(frozen=True)
class Monitor:
    """One monitor as DeskEye lays out its windows and the default region on it (deskeye/see/monitors.py reads it).

    Both rectangles are the desktop's pixels, X11's (physical pixels on X11; on Wayland Xwayland's, which the
    compositor scales, so a scaled monitor reads as 96 dpi there); sizes in the settings are logical pixels (what a
    person sees: one logical pixel is `scale` of the desktop's, scale = the monitor's DPI / 96), so the same settings
    look the same at any DPI.
    """
    rect: Rect                 # the whole monitor
    work_area: Rect            # the monitor less the panels docked on it (their struts)
    scale: float = 1.0         # physical pixels per logical pixel

    def px(self, logical: float) -> int:
        """A size in logical pixels (the settings, DeskEye's defaults) as this monitor's physical pixels."""
        return round(logical * self.scale)


@dataclass(frozen=True)
class FrameMap:
    """Where the desktop's pixels lie in a capture backend's frames, which may not share them: on Wayland DeskEye's
    windows, the monitors and the watched region are in the desktop's pixels (Xwayland's, the compositor's layout:
    logical pixels on a scaled monitor) while the portal's frames are the compositor's, in physical pixels and
    starting at the frame's own 0,0. A desktop pixel x lies at (x - origin_x) * scale_x in the frame."""
    origin_x: int = 0
    origin_y: int = 0
    scale_x: float = 1.0
    scale_y: float = 1.0

    def box(self, rect: Rect) -> tuple[int, int, int, int]:
        """`rect` (desktop pixels) as the frame's (left, top, right, bottom), every frame pixel it touches."""
        return (math.floor((rect.left - self.origin_x) * self.scale_x + EPSILON),
                math.floor((rect.top - self.origin_y) * self.scale_y + EPSILON),
                math.ceil((rect.right - self.origin_x) * self.scale_x - EPSILON),
                math.ceil((rect.bottom - self.origin_y) * self.scale_y - EPSILON))


EPSILON = 1e-6               # a scale such as 1.25 is not exact in floating point: 4 * 1.25 must stay 5, not 6
