"""Which desktop session DeskEye runs in, and so how it sees the screen: the one place that decides.

- X11: mss reads the X server's screen (deskeye/see/backends.py).
- Wayland: no X11 program sees the screen there (Xwayland hands mss an all-black image on GNOME, KDE Plasma, sway and
  weston alike, even where X11 windows are on screen), so DeskEye asks xdg-desktop-portal, as screen-sharing programs
  do: its ScreenCast where the portal offers it (a PipeWire stream: deskeye/see/portal_screencast.py; GNOME, KDE
  Plasma), else its Screenshot (deskeye/see/portal_screenshot.py; sway without a GPU, whose stream sends nothing),
  else an error naming the cause (no portal answered on the session bus) and the fix (install xdg-desktop-portal and
  the desktop's backend, or log into an X11 session). A user who declined the desktop's dialog is never looked at
  another way. The desktop asks once: DeskEye keeps the token of the user's yes (deskeye/see/portal_token.py).
  deskeye/see/backends.py opens the backend the session calls for.

The session is read from what the desktop gives its programs: XDG_SESSION_TYPE decides where it says "x11" or
"wayland" (the login manager sets it); otherwise (a terminal over ssh, startx: "tty" or unset) WAYLAND_DISPLAY means
Wayland and DISPLAY alone X11. macOS and Windows have one screen API, which mss reads.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Mapping

from deskeye.errors import CaptureError
from deskeye.language import N_, _

# What the user reads (deskeye/language.py translates it where it is raised).
NO_DISPLAY = N_("No display: DISPLAY is not set. Run DeskEye inside your desktop session, or use "
                "`deskeye describe --image FILE`.")
WAYLAND_VIA_PORTAL = N_("This is a Wayland session ({variables}): X11 capture through Xwayland is black on Wayland, "
                        "so DeskEye sees the screen there through xdg-desktop-portal.")
X11_SIGN_IN = N_("To let DeskEye see the screen, log into an X11 session: at the login screen choose \"GNOME on "
                 "Xorg\" or \"Plasma (X11)\" (the session menu by the password field).")
X11_OTHERWISE = N_("Or log into an X11 session: at the login screen choose \"GNOME on Xorg\" or \"Plasma (X11)\" (the "
                   "session menu by the password field).")
IMAGE_ANYWHERE = N_("`deskeye describe --image FILE` works in any session.")


class SessionType(StrEnum):
    X11 = "x11"
    WAYLAND = "wayland"
    NATIVE = "native"            # macOS, Windows: the system's own screen API
    NONE = "none"                # Linux without a display (a console, ssh without X forwarding)


@dataclass(frozen=True)
class Session:
    """The desktop session of this process, as its environment tells it."""
    kind: SessionType
    display: str = ""            # DISPLAY: the X server (Xwayland's, on Wayland)
    wayland_display: str = ""    # WAYLAND_DISPLAY
    environ: Mapping[str, str] = field(default_factory=lambda: os.environ, compare=False, repr=False)  # the bus

    @classmethod
    def detect(cls, environ: Mapping[str, str] = os.environ, platform: str = sys.platform) -> "Session":
        display, wayland = environ.get("DISPLAY", ""), environ.get("WAYLAND_DISPLAY", "")
        if not platform.startswith("linux"):
            return cls(SessionType.NATIVE, display, wayland, environ)
        said = environ.get("XDG_SESSION_TYPE", "").strip().lower()
        if said == SessionType.WAYLAND or (said != SessionType.X11 and wayland):
            return cls(SessionType.WAYLAND, display, wayland, environ)
        return cls(SessionType.X11 if display else SessionType.NONE, display, wayland, environ)

    def describe(self) -> str:
        """The session in a few words, naming its display variables: for `deskeye doctor`."""
        if self.kind in (SessionType.X11, SessionType.WAYLAND):
            return f"{'X11' if self.kind == SessionType.X11 else 'Wayland'} session ({self.variables()})"
        return "no display" if self.kind == SessionType.NONE else sys.platform

    def variables(self) -> str:
        """The display variables that made the decision, e.g. "WAYLAND_DISPLAY=wayland-0, Xwayland on DISPLAY=:1"."""
        if self.kind != SessionType.WAYLAND:
            return f"DISPLAY={self.display}"
        xwayland = f", Xwayland on DISPLAY={self.display}" if self.display else ""
        return f"WAYLAND_DISPLAY={self.wayland_display or '(unset)'}{xwayland}"

    def check_can_capture(self) -> None:
        """CaptureError naming the cause and the fix where DeskEye has no way to see this session's screen: no
        display, or on Wayland no portal that captures (asked on the session bus: cheap, nothing is grabbed)."""
        if self.kind == SessionType.NONE:
            raise CaptureError(_(NO_DISPLAY))
        if self.kind == SessionType.WAYLAND:
            from deskeye.see.portal_request import portal_offers
            try:
                portal_offers(self.environ)
            except CaptureError as exc:
                raise self.wayland_error(str(exc)) from None

    def wayland_error(self, problem: str) -> CaptureError:
        """The portal's problem, said with the session it is in and the other ways out (X11, an image file)."""
        return CaptureError(" ".join((_(WAYLAND_VIA_PORTAL).format(variables=self.variables()), problem,
                                      _(X11_OTHERWISE), _(IMAGE_ANYWHERE))))
