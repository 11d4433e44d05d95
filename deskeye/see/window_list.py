"""The windows of this desktop session, as privacy and masking read them: one reader per desktop, and what DeskEye
says where the desktop does not tell.

- X11: the X server's window list and active window (deskeye/see/x11_windows.py, deskeye/see/privacy.py).
- Wayland with sway, or any compositor that speaks its i3 IPC ($SWAYSOCK): the compositor's tree
  (deskeye/see/sway_windows.py), native and Xwayland windows alike, with the focused one. Title exclusions and the
  private-browser check (the window's app id and its process's command line) work as on X11.
- KDE Plasma on Wayland: KWin's own list, read with a KWin script (deskeye/see/kwin_windows.py), native and Xwayland
  windows alike, with the active one. Title exclusions and the private-browser check work as on X11.
- Wayland elsewhere (GNOME: org.gnome.Shell.Introspect refuses ordinary programs; weston): no program may read the
  native windows. Only Xwayland's X11 windows are known, and they
  are still checked as on X11.

What DeskEye does where titles are unknown (issue 23, "privacy never silently weaker"): it does not refuse to look
at all (that would make it useless on GNOME, the most used desktop), and it never keeps quiet about it. Before the
first capture it says, naming the configured exclusions it cannot enforce and what to do instead: `deskeye run` once
on stderr and in the overlay, every one-shot command (`describe`, `ask`) on stderr, `deskeye doctor` as a WARN
line. What to do, as it tells the user: keep such windows out of the watched region or pause DeskEye while they are
open; or watch one window instead of the screen (`capture.source = "window"`: only the window the user picks in the
desktop's sharing dialog is seen, whatever else is open); or log into an X11 session.

A compositor that should tell but does not answer (its IPC socket gone, too slow, a malformed reply) is not taken
for "no windows": `read()` raises, and the app and the one-shot commands look at nothing until it answers again.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Mapping

from deskeye.errors import DeskEyeError
from deskeye.language import N_, _
from deskeye.see.kwin_windows import KWinError, KWinWindow, KWinWindows, kwin_runs
from deskeye.see.privacy import SeenWindow, shown_title
from deskeye.see.session import Session, SessionType
from deskeye.see.sway_windows import SwayIpcError, SwayWindow, read_windows, socket_path
from deskeye.see.window_facts import OWN_TITLE_PREFIX, OWN_WINDOW_CLASS
from deskeye.see.x11_windows import OwnWindows, XWindow

MAX_NAMED_TITLES = 40            # exclusion entries named in the notice (the defaults hold 22)
MAX_DESKTOP_CHARS = 40           # of XDG_CURRENT_DESKTOP shown

# What the user reads (translated where it is shown).
TITLES_UNKNOWN = N_("Privacy: window titles are unknown on this Wayland desktop ({desktop}), which tells no program "
                    "which windows are on screen, so these excluded titles cannot be enforced: {titles}. Only windows "
                    "of X11 programs (Xwayland) are checked. Keep such windows out of the watched region or pause "
                    "DeskEye while they are open; or watch one window instead of the screen (capture.source = "
                    "\"window\": the desktop's sharing dialog then offers windows, and only the one you pick is "
                    "seen); or log into an X11 session (\"GNOME on Xorg\" or \"Plasma (X11)\").")
AND_MORE = N_("{titles} and {count} more")
NONE_CONFIGURED = N_("(none configured)")
WINDOWS_UNREADABLE = N_("DeskEye is not looking: it cannot read the window list from {desktop} ({error}), so it "
                        "cannot tell whether an excluded window is on screen. Nothing was captured or sent.")
KNOWN_FROM_SWAY = N_("window titles from {desktop}'s IPC ({socket}): excluded titles are enforced on every window")
KNOWN_FROM_KWIN = N_("window titles from KWin ({desktop}), read with a KWin script: excluded titles are enforced on "
                     "every window")
KNOWN_FROM_X11 = N_("window titles from the X server ({display}): excluded titles are enforced")

class WindowSource(StrEnum):
    X11 = "x11"                  # the X server's window list
    SWAY = "sway"                # sway's i3 IPC tree
    KWIN = "kwin"                # KWin's list, through a KWin script (KDE Plasma)
    NONE = "none"                # a Wayland desktop that tells no one: only Xwayland's windows are known


@dataclass(frozen=True)
class SeenWindows:
    """One reading: every window (XWindow, absolute pixels, `is_own` for DeskEye's) and the active one (None: read
    the X server's, as check_privacy does by default)."""
    windows: list[XWindow] = field(default_factory=list)
    active: SeenWindow | None = None


class SessionWindows:
    """The window list of this session (the session decides which reader), for privacy and for masking DeskEye's
    own windows. `own` knows DeskEye's X11 windows (Tk registers them); one per app, any thread may read."""

    def __init__(self, own: OwnWindows | None = None, session: Session | None = None,
                 environ: Mapping[str, str] = os.environ):
        self.own = own or OwnWindows()
        self.session = session or Session.detect(environ)
        self.socket = socket_path(environ) if self.session.kind == SessionType.WAYLAND else ""
        if self.session.kind != SessionType.WAYLAND:
            self.source = WindowSource.X11
        else:
            self.source = (WindowSource.SWAY if self.socket else WindowSource.KWIN if kwin_runs(environ)
                           else WindowSource.NONE)
        self._kwin = KWinWindows(environ) if self.source == WindowSource.KWIN else None
        self.desktop = _desktop_name(environ, self.session, self.source)

    @property
    def knows_titles(self) -> bool:
        return self.source != WindowSource.NONE

    def read(self) -> SeenWindows:
        """The windows now; DeskEyeError (with WINDOWS_UNREADABLE) where the compositor should tell and does not."""
        if self.source not in (WindowSource.SWAY, WindowSource.KWIN):
            return SeenWindows(self.own.windows())
        try:
            found = read_windows(self.socket) if self.source == WindowSource.SWAY else self._kwin.read()
        except (SwayIpcError, KWinError) as exc:
            raise DeskEyeError(_(WINDOWS_UNREADABLE).format(desktop=self.desktop, error=exc)) from None
        own_ids, pid = self.own.registered(), self.own.pid
        windows = [_as_x_window(w, own_ids, pid) for w in found if w.visible]
        # DeskEye's overlay and menus are override-redirect X11 windows: neither sway nor KWin manages them, so their
        # lists never name them; Xwayland does, in the desktop's pixels. On top.
        listed = {w.window_id for w in windows}
        windows += [w for w in self.own.windows() if w.is_own and w.window_id not in listed]
        focused = next((w for w in found if w.focused), None)
        active = SeenWindow(focused.title, focused.app, focused.pid) if focused is not None else SeenWindow(None)
        return SeenWindows(windows, active)

    def titles_unknown_notice(self, excluded_titles: list[str]) -> str:
        """What DeskEye says before its first capture where this desktop hides its windows ("" where it tells)."""
        if self.knows_titles:
            return ""
        named = [repr(shown_title(entry)) for entry in excluded_titles[:MAX_NAMED_TITLES]]
        more = len(excluded_titles) - len(named)
        titles = ", ".join(named) if named else _(NONE_CONFIGURED)
        if more > 0:
            titles = _(AND_MORE).format(titles=titles, count=more)
        return _(TITLES_UNKNOWN).format(desktop=self.desktop, titles=titles)

    def say_titles_unknown(self, excluded_titles: list[str]) -> str:
        """The notice (`titles_unknown_notice`) written to stderr now, before anything else is done; returned."""
        notice = self.titles_unknown_notice(excluded_titles)
        if notice:
            print(f"deskeye: {notice}", file=sys.stderr, flush=True)
        return notice

    def describe(self) -> str:
        """Which window list is live, for `deskeye doctor` (the notice where there is none)."""
        if self.source == WindowSource.SWAY:
            return _(KNOWN_FROM_SWAY).format(desktop=self.desktop, socket=self.socket)
        if self.source == WindowSource.KWIN:
            return _(KNOWN_FROM_KWIN).format(desktop=self.desktop)
        return _(KNOWN_FROM_X11).format(display=self.session.display or "no display")

    def close_thread(self) -> None:
        self.own.close_thread()


def _as_x_window(window: SwayWindow | KWinWindow, own_ids: frozenset[int], pid: int) -> XWindow:
    """A sway or KWin window as privacy and masking read an X11 one. DeskEye's own: an X11 window its Tk thread
    registered, its own process, or its class or title (window_facts)."""
    is_own = (window.x11_id in own_ids or window.pid == pid
              or OWN_WINDOW_CLASS in (name.casefold() for name in window.app)
              or window.title.casefold().startswith(OWN_TITLE_PREFIX))
    window_id = window.window_id if isinstance(window, KWinWindow) else window.x11_id or window.con_id
    return XWindow(window_id, window.rect, window.title, is_own, window.app, window.pid)


def _desktop_name(environ: Mapping[str, str], session: Session, source: WindowSource) -> str:
    """The desktop as its session names it (XDG_CURRENT_DESKTOP, e.g. "GNOME", "KDE", "sway"), else "sway" where
    its IPC answers, else its Wayland socket; cut and on one line (it is shown to the user)."""
    if session.kind != SessionType.WAYLAND:
        return "X11"
    name = shown_title(environ.get("XDG_CURRENT_DESKTOP", "").split(":")[0], MAX_DESKTOP_CHARS)
    if name:
        return name
    return "sway" if source == WindowSource.SWAY else f"WAYLAND_DISPLAY={shown_title(session.wayland_display, 60)}"
