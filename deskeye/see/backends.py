"""Capture backends: how DeskEye reads pixels on one kind of desktop, behind one small contract.

deskeye/see/session.py decides which backend a session gets: mss (here) on X11, the portal's ScreenCast or Screenshot
(deskeye/see/portal_screencast.py, portal_screenshot.py) on Wayland. deskeye/see/capture.py (`ScreenGrabber`) is the
only caller, with one backend per thread that grabs (mss is not thread-safe). A backend only reads: the region DeskEye
watches, the masking of its own windows and the check that a grab is not black are the grabber's.

A backend also knows its desktop well enough to say why a uniformly black grab is not the screen (`why_black`):
on X11 it is the screen where nothing but the black desktop background lies in the region, and never on Xwayland (a
DeskEye started without the Wayland session's variables: they would have taken it to the portal); from a portal it
always is the screen (the compositor's own pixels).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Protocol

from deskeye.errors import CaptureError
from deskeye.language import N_, _
from deskeye.see.geometry import Rect
from deskeye.see.session import X11_SIGN_IN, Session, SessionType

if TYPE_CHECKING:
    from PIL import Image

log = logging.getLogger(__name__)

XWAYLAND_OUTPUT_PREFIX = "XWAYLAND"     # Xwayland before 23.1 names its outputs XWAYLAND0, XWAYLAND1, ...
XWAYLAND_EXTENSION = "XWAYLAND"         # Xwayland 23.1 and later advertise this X extension

# What the user reads (translated where it is shown).
BLACK_ON_XWAYLAND = N_("This X display ({display}) is Xwayland, and X11 capture through Xwayland is black on Wayland.")
WAYLAND_VARIABLES = N_("Start DeskEye inside the Wayland session, with its WAYLAND_DISPLAY and "
                       "XDG_SESSION_TYPE=wayland set, so that it sees the screen through xdg-desktop-portal.")
SCREENCAST_FAILED_TRYING_SCREENSHOT = N_("The ScreenCast portal cannot stream here ({error}); DeskEye takes the "
                                         "portal's screenshots instead.")
WINDOW_NEEDS_WAYLAND = N_("capture.source = \"window\" shares one window through a Wayland desktop's screen-sharing "
                          "dialog; this is an X11 session: set capture.source = \"monitor\" and put the window in "
                          "capture.region.")
NOT_OFFERED = N_("This desktop's portal does not offer {capture}, which capture.portal = \"{setting}\" asks for: set "
                "capture.portal = \"auto\".")
BLACK_WINDOW_OR_HIDDEN = N_("If a black window covers that region, move it or watch another region (capture.region). "
                            "If the screen there is not black, this desktop hides it from X11 programs (a Wayland "
                            "session does: X11 capture through Xwayland is black on Wayland).")


class CaptureBackend(Protocol):
    """Reads the screen of one desktop session. Made per thread (`open_capture_backend`), closed by that thread."""

    name: str                    # what `deskeye doctor` names, e.g. "mss on the X display :0"

    def monitors(self) -> list[Rect]:
        """The monitors in mss numbering: [0] all of them stitched, [1] the primary, then the others."""

    def grab(self, rect: Rect) -> "Image.Image":
        """The pixels of `rect` (absolute screen pixels) as an RGB image; CaptureError when the grab fails."""

    def why_black(self, rect: Rect) -> str:
        """Why a uniformly black grab of `rect` is not what the screen shows, with the fix (for the user); "" where
        the desktop says the screen there is black (nothing but a black background)."""

    def close(self) -> None:
        """Release the connection (on the thread that made the backend)."""


class MssBackend:
    """X11 (and macOS, Windows): mss reads the X server's screen through XShmGetImage."""

    def __init__(self, session: Session):
        import mss

        self.session = session
        self.name = f"mss on the X display {session.display}" if session.display else "mss"
        try:
            self._sct = mss.MSS()
        except mss.ScreenShotError as exc:
            display = os.environ.get("DISPLAY", "")
            raise CaptureError(f"Cannot open the display {display!r} to capture the screen: {exc}") from None
        self._outputs = tuple(str(m.get("output", "")) for m in self._sct.monitors[1:])

    def monitors(self) -> list[Rect]:
        return [Rect(m["left"], m["top"], m["width"], m["height"]) for m in self._sct.monitors]

    def grab(self, rect: Rect) -> "Image.Image":
        import mss
        from PIL import Image

        try:
            shot = self._sct.grab(rect.as_mss())
        except mss.ScreenShotError as exc:
            raise CaptureError(f"Screen capture of {rect} failed: {exc}") from None
        return Image.frombytes("RGB", shot.size, shot.raw, "raw", "BGRX")   # not .bgra: a fresh copy, 4x slower

    def why_black(self, rect: Rect) -> str:
        if self.is_xwayland():
            return " ".join((_(BLACK_ON_XWAYLAND).format(display=self.session.display), _(WAYLAND_VARIABLES),
                             _(X11_SIGN_IN)))
        from deskeye.see.window_facts import Region
        from deskeye.see.x11_windows import windows_in_region

        if not windows_in_region(Region(rect.left, rect.top, rect.width, rect.height)):
            log.debug("the grab of %s is black, and no window is there: the desktop's background", rect)
            return ""
        return " ".join((_(BLACK_WINDOW_OR_HIDDEN), _(X11_SIGN_IN)))

    def is_xwayland(self) -> bool:
        """Whether this X server is Xwayland (its output names, or its XWAYLAND extension), whatever the
        environment says: a DeskEye started without the session's variables still knows."""
        if any(output.upper().startswith(XWAYLAND_OUTPUT_PREFIX) for output in self._outputs):
            return True
        from deskeye.see.x11_windows import open_display

        conn = open_display(self.session.display or None, "to ask whether it is Xwayland")
        if conn is None:
            return False
        try:
            return conn.query_extension(XWAYLAND_EXTENSION) is not None
        except Exception as exc:        # the X server went away: the generic message says enough
            log.debug("cannot query the X server's extensions: %s", exc)
            return False
        finally:
            conn.close()

    def close(self) -> None:
        self._sct.close()


def open_capture_backend(session: Session | None = None, *, portal: str = "auto",
                         source: str = "monitor") -> CaptureBackend:
    """The capture backend for `session` (default: this process's), or CaptureError saying why there is none.
    `portal` (capture.portal, Wayland only): "auto" = ScreenCast where the portal offers it, else Screenshot;
    "screencast" or "screenshot" = that one only. `source` (capture.source): "window" = one window the user picks in
    the desktop's ScreenCast dialog (Wayland only). Call it once per thread that grabs: a backend is not shared
    across threads."""
    session = session or Session.detect()
    if session.kind == SessionType.WAYLAND:
        if source == "window":
            return _open_window_backend(session)
        return _open_portal_backend(session, portal)
    if source == "window":
        raise CaptureError(_(WINDOW_NEEDS_WAYLAND))
    session.check_can_capture()
    return MssBackend(session)


def _open_window_backend(session: Session) -> CaptureBackend:
    """The portal's ScreenCast of one window: there is no other way to see only that window (no fallback)."""
    from deskeye.see.portal_request import portal_offers
    from deskeye.see.portal_screencast import NO_WINDOW_SOURCE, PortalScreenCastBackend
    try:
        screencast, _screenshot = portal_offers(session.environ)
    except CaptureError as exc:
        raise session.wayland_error(str(exc)) from None
    if not screencast:
        raise session.wayland_error(_(NO_WINDOW_SOURCE))
    return PortalScreenCastBackend(session, session.environ, source="window")


def _open_portal_backend(session: Session, portal: str = "auto") -> CaptureBackend:
    """The portal's ScreenCast, else its Screenshot (deskeye/see/session.py says why); CaptureError naming why
    neither works. A "no" in the desktop's dialog (PortalDeclined) is final: no other way is tried. A ScreenCast that
    failed where Screenshot works (xdg-desktop-portal-wlr without a GPU: 5 s without a frame) is not tried again by
    this process: every thread that grabs opens its backend."""
    from deskeye.see.portal_request import PortalDeclined, portal_offers
    from deskeye.see.portal_screencast import PortalScreenCastBackend
    from deskeye.see.portal_screenshot import PortalScreenshotBackend

    try:
        screencast, screenshot = portal_offers(session.environ)
    except CaptureError as exc:
        raise session.wayland_error(str(exc)) from None
    if portal == "screencast" and not screencast:
        raise session.wayland_error(_(NOT_OFFERED).format(capture="ScreenCast", setting=portal))
    if portal == "screenshot" and not screenshot:
        raise session.wayland_error(_(NOT_OFFERED).format(capture="Screenshot", setting=portal))
    screencast, screenshot = screencast and portal != "screenshot", screenshot and portal != "screencast"
    problems = [_screencast_failed[0]] if _screencast_failed[0] else []
    for offered, backend in ((screencast and not problems, PortalScreenCastBackend),
                             (screenshot, PortalScreenshotBackend)):
        if not offered:
            continue
        try:
            return backend(session, session.environ)
        except PortalDeclined:
            raise
        except CaptureError as exc:
            problems.append(str(exc))
            if backend is PortalScreenCastBackend and screenshot:
                _screencast_failed[0] = str(exc)      # each thread's backend: not tried (and waited for) again
                log.warning("%s", _(SCREENCAST_FAILED_TRYING_SCREENSHOT).format(error=exc))
    raise session.wayland_error(" ".join(problems))


_screencast_failed = [""]       # why the portal's ScreenCast did not work in this process ("" = not tried, or it did)
