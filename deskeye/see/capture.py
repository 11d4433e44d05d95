"""Screen capture: grab a region of one monitor, as a PIL image or PNG bytes, never a black frame by mistake.

The region is given relative to the chosen monitor's top-left corner (`capture.monitor`, mss numbering: 1 =
primary, 2.. = others, 0 = all monitors stitched), in the desktop's pixels (X11's; on Wayland Xwayland's, which are
logical pixels on a scaled monitor). With no region, DeskEye watches 800x600 logical pixels centred on that monitor,
inside its work area and out of the overlay's column (deskeye/see/placement.py). `watched_region` is the one
decision: the app, the one-shot commands and `doctor` build their grabber with `ScreenGrabber.for_settings`, so all of
them watch the same region. mss is not thread-safe across threads, so `ScreenGrabber` keeps one capture backend per
thread that grabs; the session decides which backend (deskeye/see/session.py: mss on X11, xdg-desktop-portal on
Wayland, or the reason there is none).

A grab that comes back empty, or uniformly black (no channel of any pixel above BLACK_MAX_LEVEL) where the desktop
does not say the screen is black, is a CaptureError naming the cause and the fix: the app shows it once and grabs
again at the next tick, the one-shot commands exit with it, `deskeye doctor` fails on it. A dark window with text is
not black.

DeskEye's own windows (overlay, Ask box, menus) are painted over with one flat colour in every frame, before
change detection and before the frame is sent: DeskEye never watches itself, wherever its windows are.

On Wayland they are Xwayland windows, their places read from X11 (deskeye/see/x11_windows.py; on sway also its
window list), while the pixels come from the compositor (deskeye/see/portal_screencast.py, portal_screenshot.py),
which need not share X11's coordinates: the portal's frame starts at its own 0,0 and is in physical pixels, while
Xwayland works in the compositor's layout (logical pixels). So the monitors DeskEye numbers, the region it watches,
privacy's window places and the masks are all in those desktop pixels (Xwayland's), and the backend maps the region
into its frame (the streamed or screenshotted output's offset, and the scale); the grab is in the frame's own pixels
(at scale 2, twice the region's size), and a mask covers every frame pixel of a window (`image_map`). Measured on
sway 1.7 headless through the portal's Screenshot (the whole layout at the largest output scale): two monitors side
by side at scale 1 with monitor 1 or 2 watched, one monitor at scale 2, and a scale-2 monitor 2 beside a scale-1
monitor 1: the frame is that monitor's pixels and the masks cover the overlay to the pixel. On GNOME the ScreenCast
portal says where the streamed monitor lies and its logical size (measured: one monitor, and two side by side, at
scale 1); a monitor at an offset or scaled there is mapped the same way but not measured. Where the backend cannot
tell where the region lies in its frames, DeskEye says so instead of guessing: a screenshot that is not Xwayland's
monitors at one scale is refused (no frame), a stream the portal does not place on one of Xwayland's monitors is
warned about once (its own windows may show in what it describes). The compositor's frame also lags X11: a frame
taken just after the overlay changed size can still show it as it was (seen: the "thinking" overlay, taller, under a
mask of the answer's size). So on Wayland a grab waits until DeskEye's windows have not changed for OWN_SETTLE_S (the
overlay says when they do: `own_windows_changed`), and masks their places read both before and after the grab.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from PIL import Image, ImageDraw

from deskeye.errors import CaptureError
from deskeye.language import N_, _
from deskeye.see.backends import CaptureBackend, open_capture_backend
from deskeye.see.geometry import FrameMap, Monitor, Rect
from deskeye.see.monitors import desktop_monitors, read_monitor
from deskeye.see.placement import default_region_on
from deskeye.see.session import Session, SessionType
from deskeye.settings import CaptureSettings, OverlaySettings, Settings, parse_region

log = logging.getLogger(__name__)

PNG_COMPRESS_LEVEL = 1            # fast: the PNG only travels to a local worker
MASK_COLOUR = (0, 0, 0)           # what DeskEye's own windows look like in a frame
MONITOR_REREAD_S = 10.0           # how long a monitor's scale and panels are trusted (a panel may start after DeskEye)
OWN_SETTLE_S = 0.4                # on Wayland: how long after DeskEye's windows changed the compositor's frames lag
MAX_SETTLE_WAITS = 5              # a grab waits at most this many OWN_SETTLE_S for them to settle
BLACK_MAX_LEVEL = 10              # a grab whose every channel of every pixel is at most this is uniformly black
# What the user reads (translated where it is raised), followed by the backend's cause and fix.
BLACK_GRAB = N_("The screen grab of {width}x{height} at {left},{top} is uniformly black, so DeskEye does not "
                "describe it.")
EMPTY_GRAB = N_("The screen grab of {width}x{height} at {left},{top} came back empty, so DeskEye has nothing to "
                "describe.")


_own_changed_at = [0.0]           # time.monotonic() when one of this process's own windows last changed on screen


def own_windows_changed() -> None:
    """Say that one of DeskEye's windows just changed on screen (shown, moved, resized, hidden): on Wayland, grabs
    wait OWN_SETTLE_S from now, until the compositor's frames show it as X11 places it (deskeye/ui/overlay.py)."""
    _own_changed_at[0] = time.monotonic()


def _wait_own_windows_settled(settle_s: float) -> None:
    """Wait until DeskEye's windows have not changed for `settle_s`, at most MAX_SETTLE_WAITS times `settle_s` (an
    answer streamed into the overlay changes it many times: the grab is late, never stopped)."""
    deadline = time.monotonic() + MAX_SETTLE_WAITS * settle_s
    while (left_s := min(_own_changed_at[0] + settle_s, deadline) - time.monotonic()) > 0:
        time.sleep(left_s)


@dataclass(frozen=True)
class Frame:
    """One grab: the pixels, where on the screen they came from, what was masked out of them, and the windows
    in it (front first, deskeye.see.window_facts)."""
    image: Image.Image
    rect: Rect
    masked: tuple[Rect, ...] = ()
    windows: tuple = field(default=(), compare=False)
    is_shared_window: bool = False     # one shared window's pixels: `rect` is in its own pixels, not the screen's

    def png(self) -> bytes:
        return to_png(self.image)

    def with_window_facts(self) -> Frame:
        """This frame with the windows in its region as they are now (read from the X server); a shared window's
        frame has no place on the screen to read them at."""
        if self.is_shared_window:
            return self
        return dataclasses.replace(self, windows=_window_facts(self.rect, self.image))

    @property
    def masks(self) -> tuple[Rect, ...]:
        """The masked rectangles in the image's own pixels (for change detection)."""
        frame_map = image_map(self.image, self.rect)
        return tuple(Rect(left, top, right - left, bottom - top)
                     for left, top, right, bottom in (frame_map.box(m) for m in self.masked))


def to_png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    return buffer.getvalue()


def check_display() -> None:
    """Raise CaptureError, naming the cause and the fix, where DeskEye cannot see this session's screen (no display
    at all, or a Wayland session where no screen-capture portal answers: deskeye/see/session.py)."""
    Session.detect().check_can_capture()


def monitor_rect(monitors: list[Rect], number: int) -> Rect:
    """The rectangle of monitor `number` in mss numbering, or CaptureError listing the valid numbers."""
    if number >= len(monitors):
        available = ", ".join(str(i) for i in range(len(monitors)))
        raise CaptureError(f"capture.monitor is {number}, but this screen has monitors {available} "
                           "(0 = all stitched, 1 = primary). Set capture.monitor to one of those.")
    return monitors[number]


def is_black(image: Image.Image) -> bool:
    """Every pixel at most BLACK_MAX_LEVEL in every channel (a dark terminal's text is far brighter). Every tick
    asks: one pixel in 16x16 is looked at first (nearest-neighbour keeps real pixels, so one bright one settles it)."""
    sample = image.resize((max(1, image.width // 16), max(1, image.height // 16)), Image.Resampling.NEAREST)
    if any(high > BLACK_MAX_LEVEL for _low, high in sample.getextrema()):
        return False
    return all(high <= BLACK_MAX_LEVEL for _low, high in image.getextrema())


def check_pixels(image: Image.Image, rect: Rect, backend: CaptureBackend) -> None:
    """CaptureError when the grab of `rect` is empty, or uniformly black where the desktop does not say the screen
    there is black (the backend's `why_black`: the cause and the fix, or "" for a black background)."""
    where = {"width": rect.width, "height": rect.height, "left": rect.left, "top": rect.top}
    if image.width * image.height == 0:
        raise CaptureError(" ".join((_(EMPTY_GRAB).format(**where), backend.why_black(rect))).strip())
    if is_black(image):
        why = backend.why_black(rect)
        if why:
            raise CaptureError(f"{_(BLACK_GRAB).format(**where)} {why}")


def watched_region(monitor: Monitor, region: tuple[int, int, int, int] | None, overlay: OverlaySettings) -> Rect:
    """The absolute rectangle DeskEye watches on `monitor`: `region` (relative to the monitor) clipped to it, else
    the default (800x600 logical pixels, centred, in the work area, out of the overlay's column)."""
    if region is None:
        return default_region_on(monitor, overlay)
    return resolve_region(monitor.rect, region)


def resolve_region(monitor: Rect, region: tuple[int, int, int, int]) -> Rect:
    """`region` (relative to the monitor) as an absolute rectangle, clipped to the monitor."""
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
    """Grabs one configured region. Safe to call from several threads: each gets its own capture backend."""

    def __init__(self, settings: CaptureSettings, region: str | tuple | None = None, *,
                 overlay: OverlaySettings | None = None, mask: Callable[[], list[Rect]] = list):
        self._monitor_number = settings.monitor
        self._portal = settings.portal       # on Wayland: which of the portal's captures (auto: ScreenCast first)
        self.watches_window = settings.source == "window"     # one shared window is the screen (Wayland)
        self._given_region = region          # from the command line (--region): it stays when the settings change
        self._region = region_from_settings(settings, region)
        self._overlay = overlay or OverlaySettings()     # where the overlay's column is: out of the default region
        self._mask = mask                    # -> rectangles to paint over (DeskEye's own windows)
        self._local = threading.local()
        self._layout_lock = threading.Lock()
        self._layout: tuple[Monitor, float] | None = None     # the monitor as last read, and when (monotonic)
        self._settle_s = OWN_SETTLE_S if Session.detect().kind == SessionType.WAYLAND else 0.0   # frames lag X11

    @classmethod
    def for_settings(cls, settings: Settings, region: str | tuple | None = None, *,
                     mask: Callable[[], list[Rect]] = list) -> "ScreenGrabber":
        """The grabber of the region DeskEye watches with `settings` (or `region`): the app, the one-shot commands
        and `doctor` all make theirs here."""
        return cls(settings.capture, region, overlay=settings.overlay, mask=mask)

    def apply(self, capture: CaptureSettings, overlay: OverlaySettings) -> None:
        """New settings while running (deskeye/live_settings.py): capture.region (unless --region set it) and the
        overlay's column that the default region keeps out of. The monitor stays: changing it needs a restart."""
        self._region = region_from_settings(capture, self._given_region)
        self._overlay = overlay

    def backend(self) -> CaptureBackend:
        """The calling thread's capture backend (made on first use: the session decides which)."""
        backend = getattr(self._local, "backend", None)
        if backend is None:
            backend = self._local.backend = open_capture_backend(
                portal=self._portal, source="window" if self.watches_window else "monitor")
        return backend

    def monitor(self) -> Rect:
        return monitor_rect(self.backend().monitors(), self._monitor_number)

    def rect(self) -> Rect:
        if self.watches_window:                  # the shared window, whole, or the region of it that was set
            window = self.monitor()
            return resolve_region(window, self._region) if self._region is not None else window
        return watched_region(self.layout(), self._region, self._overlay)

    def overlay_monitor(self) -> Rect:
        """The monitor DeskEye's overlay goes on: the watched one; with a shared window (which has no place on the
        screen DeskEye can know), capture.monitor of the desktop's monitors."""
        if not self.watches_window:
            self.rect()                          # checks the region lies on the monitor
            return self.monitor()
        self.monitor()                           # opens the stream: the desktop asks which window, the first time
        monitors = desktop_monitors()
        return monitors[min(max(self._monitor_number, 1), len(monitors) - 1)] if len(monitors) > 1 else \
            Rect(0, 0, 1280, 800)

    def privacy_region(self) -> Rect | None:
        """Where an excluded window must not be for a grab: the watched region; with a shared window, the whole
        desktop (DeskEye cannot know where that window lies, so an excluded window anywhere stops the capture)."""
        if not self.watches_window:
            return self.rect()
        monitors = desktop_monitors()
        return monitors[0] if monitors else None

    def layout(self) -> Monitor:
        """The watched monitor with its scale and work area (read again after MONITOR_REREAD_S)."""
        rect = self.monitor()
        with self._layout_lock:
            if self._layout is not None:
                monitor, read_at = self._layout
                if monitor.rect == rect and time.monotonic() - read_at < MONITOR_REREAD_S:
                    return monitor
        monitor = read_monitor(rect)
        with self._layout_lock:
            self._layout = (monitor, time.monotonic())
        return monitor

    def grab(self, *, with_windows: bool = True, own: list[Rect] | None = None) -> Frame:
        """The region now, DeskEye's windows masked (`own`: where they are, if the caller has just read it);
        `with_windows=False`: without the window facts (the capture loop reads them only for a frame it will
        describe: `Frame.with_window_facts`). CaptureError for an empty or wrongly black grab (`check_pixels`):
        checked before DeskEye's own windows are painted black. On Wayland: once DeskEye's windows have settled,
        and masked where they were before and after the grab (the module's docstring says why)."""
        rect, backend = self.rect(), self.backend()
        if self.watches_window:                  # one window's own pixels: DeskEye's windows are never in them
            image = backend.grab(rect)
            check_pixels(image, rect, backend)
            return Frame(image, rect, is_shared_window=True)
        if self._settle_s:
            _wait_own_windows_settled(self._settle_s)
        image = backend.grab(rect)
        check_pixels(image, rect, backend)
        covers = self._mask() if own is None else list(own)
        if self._settle_s and own is not None:
            covers += self._mask()
        masked = mask_image(image, rect, covers)
        return Frame(image, rect, masked, _window_facts(rect, image) if with_windows else ())

    def close_thread(self) -> None:
        """Close the calling thread's capture backend (call it at the end of a thread that grabbed)."""
        backend = getattr(self._local, "backend", None)
        if backend is not None:
            self._local.backend = None
            backend.close()


def image_map(image: Image.Image, rect: Rect) -> FrameMap:
    """Where the desktop's pixels of `rect` lie in `image`, the grab of it: the same pixels on X11; on Wayland the
    compositor's, so `image` may be larger than `rect` (a scaled monitor: its physical pixels)."""
    return FrameMap(rect.left, rect.top, image.width / max(rect.width, 1), image.height / max(rect.height, 1))


def mask_image(image: Image.Image, rect: Rect, covers: list[Rect]) -> tuple[Rect, ...]:
    """Paint each of `covers` (absolute desktop pixels) that lies in `rect` with MASK_COLOUR, in `image`'s own pixels
    (every one it touches); returns what was painted, in desktop pixels."""
    painted = tuple(part for cover in covers if (part := rect.clip(cover)) is not None)
    if painted:
        draw, frame_map = ImageDraw.Draw(image), image_map(image, rect)
        for part in painted:
            left, top, right, bottom = frame_map.box(part)
            draw.rectangle((left, top, right - 1, bottom - 1), fill=MASK_COLOUR)
    return painted


def grab_png(settings: Settings, region: str | tuple | None = None) -> bytes:
    """One PNG of the configured region (or `region`, "X,Y,W,H" relative to the monitor): for one-shot commands."""
    return grab_frame(settings, region).png()


def grab_frame(settings: Settings, region: str | tuple | None = None) -> Frame:
    """One frame (pixels and window facts) of the configured region, or `region`: for one-shot commands."""
    grabber = ScreenGrabber.for_settings(settings, region)
    try:
        return grabber.grab()
    finally:
        grabber.close_thread()


def _window_facts(rect: Rect, image: Image.Image) -> tuple:
    """The windows in `rect`, front first (() where X cannot tell: see deskeye.see.window_facts), their boxes in
    the pixels of `image`, the grab of `rect` (on a scaled Wayland monitor, not X11's)."""
    from deskeye.see.window_facts import Region
    from deskeye.see.x11_windows import windows_in_region
    facts = windows_in_region(Region(rect.left, rect.top, rect.width, rect.height))
    if image.size == (rect.width, rect.height):
        return tuple(facts)
    scale = image_map(image, Rect(0, 0, rect.width, rect.height))

    def scaled(box: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
        return scale.box(Rect(box[0], box[1], box[2] - box[0], box[3] - box[1]))
    return tuple(dataclasses.replace(fact, box=scaled(fact.box), frame=scaled(fact.frame)) for fact in facts)

