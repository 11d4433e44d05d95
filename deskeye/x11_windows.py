"""The X server's mapped top-level windows: where they are, their titles, and which are DeskEye's own.

Masking (DeskEye never watches its own overlay, Ask box or menus) and privacy (no frame while an excluded
window is in the watched region) both read this list. Each thread keeps its own Xlib connection (Xlib is
not thread-safe). A window that vanishes while it is read is skipped; with no X server the list is empty.

DeskEye's own windows are known two ways: the ids its Tk thread registers (`OwnWindows.register`), and
`_NET_WM_PID` equal to this process (GTK sets it on the tray's menus). With a reparenting window manager
the root's child is the manager's frame, so its direct children are checked too.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import dataclass

from deskeye.geometry import Rect

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class XWindow:
    window_id: int
    rect: Rect                 # absolute screen pixels (the frame's, under a reparenting window manager)
    title: str                 # "" when the window has no name
    is_own: bool               # one of DeskEye's windows (overlay, Ask box, menus)


class OwnWindows:
    """Ids of DeskEye's Tk windows (registered by the Tk thread) plus a per-thread reader of the window list."""

    def __init__(self, pid: int | None = None, display_name: str | None = None):
        self.pid = pid if pid is not None else os.getpid()
        self.display_name = display_name       # None = $DISPLAY
        self._ids: set[int] = set()
        self._lock = threading.Lock()
        self._local = threading.local()

    def register(self, window_id: int) -> None:
        with self._lock:
            self._ids.add(int(window_id))

    def unregister(self, window_id: int) -> None:
        with self._lock:
            self._ids.discard(int(window_id))

    def _registered(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._ids)

    def windows(self) -> list[XWindow]:
        """Every viewable top-level window, bottom to top; [] without an X display."""
        conn = self._connection()
        if conn is None:
            return []
        try:
            return list_windows(conn, self._registered(), self.pid)
        except Exception as exc:        # the connection broke (X server gone): start afresh next time
            log.debug("reading the window list failed: %s", exc)
            self.close_thread()
            return []

    def own_rects(self) -> list[Rect]:
        return [w.rect for w in self.windows() if w.is_own]

    def _connection(self):
        conn = getattr(self._local, "conn", None)
        if conn is None and sys.platform.startswith("linux") and (self.display_name or os.environ.get("DISPLAY")):
            try:
                from Xlib import display
                conn = display.Display(self.display_name)
            except Exception as exc:
                log.debug("cannot open the X display to list windows: %s", exc)
                return None
            self._local.conn = conn
        return conn

    def close_thread(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            self._local.conn = None
            try:
                conn.close()
            except Exception:
                pass


def list_windows(conn, own_ids: frozenset[int], pid: int) -> list[XWindow]:
    from Xlib import X
    from Xlib.error import XError
    pid_atom = conn.intern_atom("_NET_WM_PID")
    found = []
    for window in conn.screen().root.query_tree().children:
        try:
            if window.get_attributes().map_state != X.IsViewable:
                continue
            geometry = window.get_geometry()
            clients = [window, *window.query_tree().children]
            is_own = any(c.id in own_ids or _pid_of(c, pid_atom, X) == pid for c in clients)
            title = next((t for t in (window_title(conn, c) for c in clients) if t), "")
        except XError:                  # gone while we looked: not on screen any more
            continue
        found.append(XWindow(window.id, Rect(geometry.x, geometry.y, geometry.width, geometry.height), title,
                             is_own))
    return found


def _pid_of(window, pid_atom, X) -> int | None:
    prop = window.get_full_property(pid_atom, X.AnyPropertyType)
    return int(prop.value[0]) if prop is not None and len(prop.value) else None


def window_title(conn, window) -> str:
    """The window's _NET_WM_NAME (UTF-8), else WM_NAME, else "" (the reader privacy and window facts share)."""
    prop = window.get_full_property(conn.intern_atom("_NET_WM_NAME"), conn.intern_atom("UTF8_STRING"))
    if prop is not None and prop.value:
        value = prop.value
        return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    name = window.get_wm_name()
    if isinstance(name, bytes):
        return name.decode("latin-1")
    return name or ""


def work_area() -> Rect | None:
    """The desktop's work area (`_NET_WORKAREA`: the screen less the panels), or None when unknown."""
    if not sys.platform.startswith("linux") or not os.environ.get("DISPLAY"):
        return None
    try:
        from Xlib import X, display
        conn = display.Display()
    except Exception:
        return None
    try:
        prop = conn.screen().root.get_full_property(conn.intern_atom("_NET_WORKAREA"), X.AnyPropertyType)
        if prop is None or len(prop.value) < 4:
            return None
        x, y, width, height = (int(v) for v in prop.value[:4])
        return Rect(x, y, width, height) if width > 0 and height > 0 else None
    except Exception as exc:
        log.debug("cannot read the work area: %s", exc)
        return None
    finally:
        conn.close()
