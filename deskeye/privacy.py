"""Privacy: DeskEye does not look while a sensitive window (password manager, private browsing) is active.

The active window's title comes from the X server (python-xlib): `_NET_ACTIVE_WINDOW` when a window
manager publishes it, else the input-focus window (walking up to the window that has a name), else
the top-level window under the pointer (no window manager: focus follows the pointer). DeskEye also does
not look while a window with an excluded title is visible anywhere in the watched region, even when it is
not active (a one-shot `deskeye describe --region` runs from a terminal, which is the active window).
Frames are refused before any request is made; the app and the one-shot commands give the same reason.
A title is matched whole but shown cut to MAX_SHOWN_TITLE_CHARS: any program can set a title of megabytes.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

from deskeye.x11_windows import window_title

log = logging.getLogger(__name__)

MAX_TREE_DEPTH = 16
XDOTOOL_TIMEOUT_S = 2.0
MAX_SHOWN_TITLE_CHARS = 200       # a window title in a notice: enough to recognise the window
ELLIPSIS = "…"


@dataclass(frozen=True)
class PrivacyVerdict:
    is_excluded: bool
    title: str | None          # the excluded window's title (else the active one's), None when unknown
    matched: str = ""          # the exclusion entry that matched
    where: str = "the active window"   # or "a window in the watched region"

    @property
    def reason(self) -> str:
        return (f"DeskEye is not looking: {self.where} ({shown_title(self.title)!r}) matches the exclusion entry "
                f"{shown_title(self.matched)!r}. Nothing was captured or sent.") if self.is_excluded else ""


def shown_title(title: str | None, max_chars: int = MAX_SHOWN_TITLE_CHARS) -> str:
    """A window title as it may be shown to the user: on one line (control characters become spaces) and at most
    `max_chars` characters, cut with an ellipsis. Only the head is looked at, so a title of megabytes costs
    nothing here."""
    if not title:
        return ""
    head = title[:max_chars + 1]
    text = "".join(" " if ch < " " or ch == "\x7f" else ch for ch in head).strip()
    if len(title) > max_chars or len(text) > max_chars:
        return text[:max_chars - 1].rstrip() + ELLIPSIS
    return text


def matching_exclusion(title: str | None, excluded_titles: list[str]) -> str:
    """The first entry that is a case-insensitive substring of `title`, or ""."""
    if not title:
        return ""
    lowered = title.casefold()
    return next((entry for entry in excluded_titles if entry and entry.casefold() in lowered), "")


def check_privacy(excluded_titles: list[str], title_reader=None, *, region=None, windows=()) -> PrivacyVerdict:
    """Excluded when the active window's title matches, or when one of `windows` (deskeye.x11_windows.XWindow)
    that is not DeskEye's own and overlaps `region` (a Rect) does."""
    title = (title_reader or active_window_title)()
    matched = matching_exclusion(title, excluded_titles)
    if matched:
        return PrivacyVerdict(True, title, matched)
    if region is not None:
        for window in windows:
            entry = "" if window.is_own else matching_exclusion(window.title, excluded_titles)
            if entry and window.rect.intersects(region):
                return PrivacyVerdict(True, window.title, entry, "a window in the watched region")
    return PrivacyVerdict(False, title)


def active_window_title() -> str | None:
    """The title of the window the user is working in, or None when it cannot be known."""
    if not sys.platform.startswith("linux") or not os.environ.get("DISPLAY"):
        return None
    try:
        return _xlib_active_title()
    except ImportError:
        return _xdotool_active_title()
    except Exception as exc:   # an X error (window gone mid-query, display closed): unknown this time
        log.debug("Cannot read the active window title: %s", exc)
        return None


def _xlib_active_title() -> str | None:
    from Xlib import X, display
    conn = display.Display()
    try:
        window = _active_window(conn, X)
        return _named_ancestor_title(conn, window) if window is not None else None
    finally:
        conn.close()


def _active_window(conn, X):
    root = conn.screen().root
    prop = root.get_full_property(conn.intern_atom("_NET_ACTIVE_WINDOW"), X.AnyPropertyType)
    if prop is not None and len(prop.value) and prop.value[0]:
        return conn.create_resource_object("window", int(prop.value[0]))
    focus = conn.get_input_focus().focus
    if isinstance(focus, int):          # PointerRoot (1) or None (0): keys go to the window under the pointer
        child = root.query_pointer().child
        return child if child and not isinstance(child, int) else None
    return None if focus.id == root.id else focus


def _named_ancestor_title(conn, window) -> str | None:
    """The title of `window` or its nearest named ancestor (Tk and toolkits focus an unnamed child)."""
    root_id = conn.screen().root.id
    for _ in range(MAX_TREE_DEPTH):
        title = window_title(conn, window)
        if title:
            return title
        parent = window.query_tree().parent
        if not parent or isinstance(parent, int) or parent.id == root_id:
            return _named_child_title(conn, window)
        window = parent
    return None


def _named_child_title(conn, window) -> str | None:
    """A reparenting WM's frame has no name; its client child does."""
    for child in window.query_tree().children:
        title = window_title(conn, child)
        if title:
            return title
    return None


def _xdotool_active_title() -> str | None:
    xdotool = shutil.which("xdotool")
    if not xdotool:
        return None
    for argv in ([xdotool, "getactivewindow", "getwindowname"], [xdotool, "getwindowfocus", "getwindowname"]):
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=XDOTOOL_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.strip()
    return None
