"""Privacy: DeskEye does not look while a sensitive window (password manager, private browsing) is active.

Which windows there are, and which is active, is the session's window list (deskeye/see/window_list.py): the X
server's; on Wayland sway's IPC tree, or, where the desktop tells no one, only Xwayland's, which DeskEye says before
it looks. On X11 the active window comes from the X server (python-xlib): `_NET_ACTIVE_WINDOW` when a window manager
publishes it, else the input-focus window (walking up to the window that has a name), else the top-level window under
the pointer (no window manager: focus follows the pointer). DeskEye also does not look while an excluded window is
visible anywhere in the watched region, even when it is not active (a one-shot `deskeye describe --region` runs
from a terminal, which is the active window). Frames are refused before any request is made; the app and the
one-shot commands give the same reason, which names the window.

A window is excluded two ways:
- its title contains an exclusion entry (`capture.excluded_titles` + `capture.extra_excluded_titles`; the defaults
  hold each browser's private-window words in English and Chinese, deskeye/settings.py). Title and entry are
  compared after NFKC and case folding, the entry without its outer spaces, so no configured entry is lost to
  letter case, full-width forms or a stray space. A title is matched whole but shown cut to MAX_SHOWN_TITLE_CHARS:
  any program can set a title of megabytes.
- it belongs to a browser that was started private: the window's WM_CLASS (on sway a native window's app id)
  names a browser and the command line of its `_NET_WM_PID` process (on sway the pid the compositor knows) holds a
  private flag (`--incognito`, `--private-window`, ...), whatever the language. This is the only
  locale-independent sign a private window gives on X11: Firefox ESR 153 and
  Chromium 156 private windows carry the same WM_CLASS, WM_WINDOW_ROLE ("browser"), icon and window type as
  normal ones (compared with xprop), and Chromium's title marks only its new-tab page. A private window opened
  from a browser already running normally (Ctrl+Shift+N) has no such sign; its title is all there is.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
import unicodedata
from dataclasses import dataclass

from deskeye.language import N_, _
from deskeye.see.x11_windows import window_class, window_pid, window_title

log = logging.getLogger(__name__)

MAX_TREE_DEPTH = 16
XDOTOOL_TIMEOUT_S = 2.0
MAX_SHOWN_TITLE_CHARS = 200       # a window title in a notice: enough to recognise the window
MAX_CMDLINE_BYTES = 1 << 16       # a process's command line read for a private flag; the flags come first
ELLIPSIS = "…"

# WM_CLASS class names (compared case-folded) of the browsers whose private mode a command-line flag starts.
# Seen: Chromium ("chromium", "Chromium"), Firefox ESR ("Navigator", "firefox-esr"); the others by the same rule
# (the program's name): Google-chrome, Brave-browser, Microsoft-edge, firefox.
BROWSER_CLASSES = frozenset({
    "firefox", "firefox-esr", "firefox-nightly", "firefox-developer-edition", "librewolf",
    "chromium", "chromium-browser", "google-chrome", "google-chrome-beta", "google-chrome-unstable",
    "brave-browser", "brave-browser-beta", "brave-browser-nightly",
    "microsoft-edge", "microsoft-edge-beta", "microsoft-edge-dev",
})
# The flags that open private windows: Firefox -private-window / -private (its own "permanent private browsing");
# Chromium, Chrome, Brave and Edge --incognito; Edge --inprivate; Brave --tor (a private window through Tor).
# Both prefixes: Firefox takes either, Chromium's switch parser takes "-" too on POSIX.
PRIVATE_FLAGS = frozenset(f"{dash}{name}" for dash in ("-", "--")
                          for name in ("private-window", "private", "incognito", "inprivate", "tor"))

# What the user is told (translated where it is shown: the language is known once the settings are read).
WHERE_ACTIVE = N_("the active window")
WHERE_REGION = N_("a window in the watched region")
REFUSED_BY_TITLE = N_("DeskEye is not looking: {where} ({title}) matches the exclusion entry {entry}. "
                      "Nothing was captured or sent.")
REFUSED_BY_FLAG = N_("DeskEye is not looking: {where} ({title}) is a private browser window ({browser} was "
                     "started with {flag}). Nothing was captured or sent.")


@dataclass(frozen=True)
class SeenWindow:
    """What privacy reads of one window: its title, WM_CLASS and the process that owns it."""
    title: str | None
    wm_class: tuple[str, ...] = ()
    pid: int | None = None


@dataclass(frozen=True)
class PrivacyVerdict:
    is_excluded: bool
    title: str | None          # the excluded window's title (else the active one's), None when unknown
    matched: str = ""          # the exclusion entry that matched (by title)
    where: str = WHERE_ACTIVE  # or WHERE_REGION
    flag: str = ""             # the private flag its browser was started with (by command line)
    browser: str = ""          # that browser's WM_CLASS class

    @property
    def reason(self) -> str:
        if not self.is_excluded:
            return ""
        title, where = repr(shown_title(self.title)), _(self.where)
        if self.flag:
            return _(REFUSED_BY_FLAG).format(where=where, title=title, browser=self.browser, flag=self.flag)
        return _(REFUSED_BY_TITLE).format(where=where, title=title, entry=repr(shown_title(self.matched)))


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


def _folded(text: str) -> str:
    return unicodedata.normalize("NFKC", text).casefold()


def matching_exclusion(title: str | None, excluded_titles: list[str]) -> str:
    """The first entry found in `title` (both NFKC-normalised and case-folded, the entry stripped), or ""."""
    if not title:
        return ""
    folded = _folded(title)
    return next((entry for entry in excluded_titles if (needle := _folded(entry).strip()) and needle in folded),
                "")


def private_browser_flag(window: SeenWindow) -> tuple[str, str]:
    """(browser class, flag) when `window` belongs to a browser whose process was started with a private flag,
    else ("", ""). Reads /proc/<pid>/cmdline; a process that is gone or unreadable says nothing."""
    browser = next((name for name in _class_names(window.wm_class) if name in BROWSER_CLASSES), "")
    if not browser or not window.pid or window.pid <= 0 or not sys.platform.startswith("linux"):
        return "", ""
    try:
        with open(f"/proc/{window.pid}/cmdline", "rb") as file:
            argv = file.read(MAX_CMDLINE_BYTES).split(b"\0")
    except OSError:
        return "", ""
    for raw in argv[1:]:
        arg = raw.decode("utf-8", "replace")
        flag = arg.split("=", 1)[0]
        if flag in PRIVATE_FLAGS:
            return browser, flag
    return "", ""


def _class_names(wm_class: tuple[str, ...]) -> list[str]:
    """WM_CLASS class, then instance, case-folded; an instance like "chromium (/path)" (Chromium with its own
    --user-data-dir) counts by its first word."""
    return [name.split(" ", 1)[0].casefold() for name in reversed(wm_class) if name]


def verdict_for(window: SeenWindow, excluded_titles: list[str], where: str = WHERE_ACTIVE) -> PrivacyVerdict | None:
    """The refusal `window` calls for (an excluded title first, then a private browser's flag), else None."""
    entry = matching_exclusion(window.title, excluded_titles)
    if entry:
        return PrivacyVerdict(True, window.title, entry, where)
    browser, flag = private_browser_flag(window)
    if flag:
        return PrivacyVerdict(True, window.title, where=where, flag=flag, browser=browser)
    return None


def check_privacy(excluded_titles: list[str], title_reader=None, *, region=None, windows=(),
                  active: SeenWindow | None = None) -> PrivacyVerdict:
    """Excluded when the active window is (see the module's doc), or when one of `windows`
    (deskeye.see.x11_windows.XWindow) that is not DeskEye's own and overlaps `region` (a Rect) is.
    `active`: the active window where the session's window list knows it (sway: deskeye/see/window_list.py), else
    `title_reader` when given (the active window's title alone: no class, no process), else the X server's."""
    if active is None:
        active = SeenWindow(title_reader()) if title_reader is not None else active_window()
    verdict = verdict_for(active, excluded_titles)
    if verdict is not None:
        return verdict
    if region is not None:
        for window in windows:
            if window.is_own or not window.rect.intersects(region):
                continue
            seen = SeenWindow(window.title, getattr(window, "wm_class", ()), getattr(window, "pid", None))
            verdict = verdict_for(seen, excluded_titles, WHERE_REGION)
            if verdict is not None:
                return verdict
    return PrivacyVerdict(False, active.title)


def active_window_title() -> str | None:
    """The title of the window the user is working in, or None when it cannot be known."""
    return active_window().title


def active_window() -> SeenWindow:
    """The window the user is working in (title None when it cannot be known)."""
    if not sys.platform.startswith("linux") or not os.environ.get("DISPLAY"):
        return SeenWindow(None)
    try:
        return _xlib_active_window()
    except ImportError:
        return SeenWindow(_xdotool_active_title())
    except Exception as exc:   # an X error (window gone mid-query, display closed): unknown this time
        log.debug("Cannot read the active window: %s", exc)
        return SeenWindow(None)


_kept = threading.local()      # per thread: the X connection the active window is read through. Opening one costs
                               # ~8 ms of CPU, and the app's capture loop asks at every tick.


def _xlib_active_window() -> SeenWindow:
    try:
        return _read_active_window(_thread_connection())
    except Exception:          # a kept connection may be dead (its X server restarted): once more on a new one
        _drop_thread_connection()
        return _read_active_window(_thread_connection())


def _read_active_window(conn) -> SeenWindow:
    from Xlib import X
    window = _active_window(conn, X)
    named, title = _named_window(conn, window) if window is not None else (None, None)
    if named is None:
        return SeenWindow(None)
    return SeenWindow(title, window_class(named), window_pid(conn, named))


def _thread_connection():
    """This thread's X connection to $DISPLAY, opened on first use (and again when $DISPLAY changed)."""
    from Xlib import display
    name = os.environ.get("DISPLAY", "")
    kept = getattr(_kept, "conn", None)
    if kept is not None and kept[0] == name:
        return kept[1]
    _drop_thread_connection()
    conn = display.Display()
    _kept.conn = (name, conn)
    return conn


def _drop_thread_connection() -> None:
    kept = getattr(_kept, "conn", None)
    _kept.conn = None
    if kept is not None:
        try:
            kept[1].close()
        except Exception:          # already broken: nothing to close
            pass


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


def _named_window(conn, window) -> tuple:
    """(window, title) of `window` or its nearest named ancestor (Tk and toolkits focus an unnamed child), else of a
    named child of the top-level (a reparenting WM's frame has no name; its client child does); (None, None) when
    none has a name."""
    root_id = conn.screen().root.id
    for _ in range(MAX_TREE_DEPTH):
        title = window_title(conn, window)
        if title:
            return window, title
        parent = window.query_tree().parent
        if not parent or isinstance(parent, int) or parent.id == root_id:
            return next(((child, title) for child in window.query_tree().children
                         if (title := window_title(conn, child))), (None, None))
        window = parent
    return None, None


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
