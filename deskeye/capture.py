"""Screen capture: grab a region of one monitor with mss, as a PIL image or PNG bytes.

The region is given relative to the chosen monitor's top-left corner (`capture.monitor`, mss
numbering: 1 = primary, 2.. = others, 0 = all monitors stitched). With no region, DeskEye watches
800x600 centred on that monitor, kept out of the overlay's column (deskeye/placement.py). mss is not
thread-safe across threads, so `ScreenGrabber` keeps one mss instance per thread that grabs.

DeskEye's own windows (overlay, Ask box, menus) are painted over with one flat colour in every frame, before
change detection and before the frame is sent: DeskEye never watches itself, wherever its windows are.
"""

from __future__ import annotations

import io
import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Callable

from PIL import Image, ImageDraw

from deskeye.errors import CaptureError
from deskeye.geometry import Rect
from deskeye.settings import CaptureSettings, Settings, parse_region

log = logging.getLogger(__name__)

PNG_COMPRESS_LEVEL = 1            # fast: the PNG only travels to a local worker
MASK_COLOUR = (0, 0, 0)           # what DeskEye's own windows look like in a frame


@dataclass(frozen=True)
class Frame:
    """One grab: the pixels, where on the screen they came from, what was masked out of them, and the windows
    in it (front first, deskeye.window_facts)."""
    image: Image.Image
    rect: Rect
    masked: tuple[Rect, ...] = ()
    windows: tuple = field(default=(), compare=False)

    def png(self) -> bytes:
        return to_png(self.image)

    @property
    def masks(self) -> tuple[Rect, ...]:
        """The masked rectangles in the image's own pixels (for change detection)."""
        return tuple(Rect(m.left - self.rect.left, m.top - self.rect.top, m.width, m.height) for m in self.masked)


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


def resolve_region(monitor: Rect, region: tuple[int, int, int, int] | None, avoid: Rect | None = None) -> Rect:
    """The absolute rectangle to grab: `region` (relative to the monitor) clipped to it, or the default
    800x600 centred and kept out of `avoid` (the overlay's column)."""
    if region is None:
        from deskeye.placement import default_region
        return default_region(monitor, avoid)
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

    def __init__(self, settings: CaptureSettings, region: str | tuple | None = None, *,
                 avoid: Callable[[Rect], Rect | None] = lambda monitor: None,
                 mask: Callable[[], list[Rect]] = list):
        self._monitor_number = settings.monitor
        self._region = region_from_settings(settings, region)
        self._avoid = avoid                  # monitor -> the overlay's column, kept out of the default region
        self._mask = mask                    # -> rectangles to paint over (DeskEye's own windows)
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
        monitor = self.monitor()
        return resolve_region(monitor, self._region, self._avoid(monitor))

    def grab(self) -> Frame:
        import mss
        rect = self.rect()
        try:
            shot = self._mss().grab(rect.as_mss())
        except mss.ScreenShotError as exc:
            raise CaptureError(f"Screen capture of {rect} failed: {exc}") from None
        image = Image.frombytes("RGB", shot.size, shot.bgra, "raw", "BGRX")
        masked = mask_image(image, rect, self._mask())
        return Frame(image, rect, masked, _window_facts(rect))

    def close_thread(self) -> None:
        """Close the calling thread's mss instance (call it at the end of a thread that grabbed)."""
        sct = getattr(self._local, "sct", None)
        if sct is not None:
            self._local.sct = None
            sct.close()


def mask_image(image: Image.Image, rect: Rect, covers: list[Rect]) -> tuple[Rect, ...]:
    """Paint each of `covers` (absolute pixels) that lies in `rect` with MASK_COLOUR; returns what was painted."""
    painted = tuple(part for cover in covers if (part := rect.clip(cover)) is not None)
    if painted:
        draw = ImageDraw.Draw(image)
        for part in painted:
            x, y = part.left - rect.left, part.top - rect.top
            draw.rectangle((x, y, x + part.width - 1, y + part.height - 1), fill=MASK_COLOUR)
    return painted


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

