"""Rectangles in absolute screen pixels: the one type capture, placement, masking and privacy share."""

from __future__ import annotations

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
        return self.left < other.right and other.left < self.right and self.top < other.bottom and other.top < self.bottom

    def clip(self, other: "Rect") -> "Rect | None":
        """The part of `other` inside this rectangle, or None."""
        left, top = max(self.left, other.left), max(self.top, other.top)
        right, bottom = min(self.right, other.right), min(self.bottom, other.bottom)
        return Rect(left, top, right - left, bottom - top) if right > left and bottom > top else None


@dataclass(frozen=True)
class Monitor:
    """One monitor as DeskEye lays out its windows and the default region on it (deskeye/see/monitors.py reads it).

    Both rectangles are physical pixels; sizes in the settings are logical pixels (what a person sees: one logical
    pixel is `scale` physical ones, scale = the monitor's DPI / 96), so the same settings look the same at any DPI.
    """
    rect: Rect                 # the whole monitor
    work_area: Rect            # the monitor less the panels docked on it (their struts)
    scale: float = 1.0         # physical pixels per logical pixel

    def px(self, logical: float) -> int:
        """A size in logical pixels (the settings, DeskEye's defaults) as this monitor's physical pixels."""
        return round(logical * self.scale)
