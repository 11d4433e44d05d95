"""Screen capture: grab a region of one monitor with mss, as a PIL image or PNG bytes.

The region is given relative to the chosen monitor's top-left corner (`capture.monitor`, mss
numbering: 1 = primary, 2.. = others, 0 = all monitors stitched). With no region, DeskEye watches
800x600 centred on that monitor. mss is not thread-safe across threads, so `ScreenGrabber` keeps one
mss instance per thread that grabs.
"""

from __future__ import annotations

import io
import logging
import os
import sys
import threading
from dataclasses import dataclass

from PIL import Image

from deskeye.errors import CaptureError
from deskeye.settings import CaptureSettings, Settings, parse_region

log = logging.getLogger(__name__)

DEFAULT_REGION_SIZE = (800, 600)
PNG_COMPRESS_LEVEL = 1            # fast: the PNG only travels to a local worker


@dataclass(frozen=True)
class Rect:
    """A rectangle in absolute screen pixels."""
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


@dataclass(frozen=True)
class Frame:
    """One grab: the pixels, where on the screen they came from, and the windows in it (front first)."""
    image: Image.Image
    rect: Rect
    windows: tuple = ()           # inference_worker.protocol.WindowFact, from deskeye.window_facts

    def png(self) -> bytes:
        return to_png(self.image)


def to_png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    return buffer.getvalue()


def check_display() -> None:
    """Raise CaptureError when there is no X display to look at (Linux only; other OSes always have one)."""
    if sys.platform.startswith("linux") and not os.environ.get("DISPLAY"):
        raise CaptureError("No display: DISPLAY is not set. Run DeskEye inside your desktop session "
                           "(on Wayland, under XWayland), or use `deskeye describe --image FILE`.")


def monitor_rect(monitors: list[dict], number: int) -> Rect:
    """The rectangle of monitor `number` in mss numbering, or CaptureError listing the valid numbers."""
    if number >= len(monitors):
        available = ", ".join(str(i) for i in range(len(monitors)))
        raise CaptureError(f"capture.monitor is {number}, but this screen has monitors {available} "
                           "(0 = all stitched, 1 = primary). Set capture.monitor to one of those.")
    mon = monitors[number]
    return Rect(mon["left"], mon["top"], mon["width"], mon["height"])


def resolve_region(monitor: Rect, region: tuple[int, int, int, int] | None) -> Rect:
    """The absolute rectangle to grab: `region` (relative to the monitor) clipped to it, or 800x600 centred."""
    if region is None:
        width, height = min(DEFAULT_REGION_SIZE[0], monitor.width), min(DEFAULT_REGION_SIZE[1], monitor.height)
        return Rect(monitor.left + (monitor.width - width) // 2, monitor.top + (monitor.height - height) // 2,
                    width, height)
    x, y, width, height = region
    if x >= monitor.width or y >= monitor.height:
        raise CaptureError(f"The region {x},{y},{width},{height} starts outside the monitor, which is "
                           f"{monitor.width}x{monitor.height}. Use --region X,Y,W,H with X < {monitor.width} "
                           f"and Y < {monitor.height} (relative to the monitor's top-left corner).")
    clipped = Rect(monitor.left + x, monitor.top + y, min(width, monitor.width - x), min(height, monitor.height - y))
    if (clipped.width, clipped.height) != (width, height):
        log.warning("The region %d,%d,%d,%d extends past the %dx%d monitor; watching %dx%d instead.",
                    x, y, width, height, monitor.width, monitor.height, clipped.width, clipped.height)
    return clipped


def region_from_settings(settings: CaptureSettings, region: str | tuple | None = None) -> tuple | None:
    if isinstance(region, tuple):
        return region
    text = region if region else settings.region
    return parse_region(text, key="--region" if region else "capture.region") if text else None


class ScreenGrabber:
    """Grabs one configured region. Safe to call from several threads: each gets its own mss instance."""

    def __init__(self, settings: CaptureSettings, region: str | tuple | None = None):
        self._monitor_number = settings.monitor
        self._region = region_from_settings(settings, region)
        self._local = threading.local()

    def _mss(self):
        sct = getattr(self._local, "sct", None)
        if sct is None:
            check_display()
            import mss
            try:
                sct = mss.MSS()
            except mss.ScreenShotError as exc:
                display = os.environ.get("DISPLAY", "")
                raise CaptureError(f"Cannot open the display {display!r} to capture the screen: {exc}") from None
            self._local.sct = sct
        return sct

    def monitor(self) -> Rect:
        return monitor_rect(self._mss().monitors, self._monitor_number)

    def rect(self) -> Rect:
        return resolve_region(self.monitor(), self._region)

    def grab(self) -> Frame:
        import mss
        rect = self.rect()
        try:
            shot = self._mss().grab(rect.as_mss())
        except mss.ScreenShotError as exc:
            raise CaptureError(f"Screen capture of {rect} failed: {exc}") from None
        image = Image.frombytes("RGB", shot.size, shot.bgra, "raw", "BGRX")
        return Frame(image, rect, _window_facts(rect))

    def close_thread(self) -> None:
        """Close the calling thread's mss instance (call it at the end of a thread that grabbed)."""
        sct = getattr(self._local, "sct", None)
        if sct is not None:
            self._local.sct = None
            sct.close()


def grab_png(settings: Settings, region: str | tuple | None = None) -> bytes:
    """One PNG of the configured region (or `region`, "X,Y,W,H" relative to the monitor): for one-shot commands."""
    return grab_frame(settings, region).png()


def grab_frame(settings: Settings, region: str | tuple | None = None) -> Frame:
    """One frame (pixels and window facts) of the configured region, or `region`: for one-shot commands."""
    grabber = ScreenGrabber(settings.capture, region)
    try:
        return grabber.grab()
    finally:
        grabber.close_thread()


def _window_facts(rect: Rect) -> tuple:
    """The windows in `rect`, front first (() where X cannot tell: see deskeye.window_facts)."""
    from deskeye.window_facts import Region, windows_in_region
    return tuple(windows_in_region(Region(rect.left, rect.top, rect.width, rect.height)))

