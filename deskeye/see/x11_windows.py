"""DeskEye's one reader of the X server's windows (python-xlib): the mapped top-level windows, their titles, which are
DeskEye's own, the work area, and the window facts of a region.

Masking (DeskEye never watches its own overlay, Ask box or menus) and privacy (no frame while an excluded
window is in the watched region) both read the window list. Each thread keeps its own Xlib connection (Xlib is
not thread-safe). A window that vanishes while it is read is skipped; with no X server the list is empty.

DeskEye's own windows are known two ways: the ids its Tk thread registers (`OwnWindows.register`), and
`_NET_WM_PID` equal to this process (GTK sets it on the tray's menus). With a reparenting window manager
the root's child is the manager's frame, so its direct children are checked too.

Window facts (`windows_in_region`, what travels with a frame: deskeye/see/window_facts.py): the stacking order
from the window manager's `_NET_CLIENT_LIST_STACKING` (else the root's children, bottom to top, mapped only), each
window's title, WM_CLASS, its client area and its frame (the window manager's decorations: the top-level ancestor
under the root) translated into the region's pixels.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import dataclass

from deskeye.see.geometry import Rect
from deskeye.see.window_facts import MAX_WINDOW_FACTS, Region, WindowFact, is_own_window, shows_in, visible

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class XWindow:
    window_id: int
    rect: Rect                 # absolute screen pixels (the frame's, under a reparenting window manager)
    title: str                 # "" when the window has no name
    is_own: bool               # one of DeskEye's windows (overlay, Ask box, menus)
    wm_class: tuple[str, ...] = ()   # the named client's WM_CLASS (instance, class): privacy knows browsers by it
    pid: int | None = None           # the named client's _NET_WM_PID: privacy reads that process's command line


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

    def registered(self) -> frozenset[int]:
        """The ids of DeskEye's X11 windows (on Wayland the compositor lists its Xwayland windows by them)."""
        with self._lock:
            return frozenset(self._ids)

    def windows(self) -> list[XWindow]:
        """Every viewable top-level window, bottom to top; [] without an X display."""
        conn = self._connection()
        if conn is None:
            return []
        try:
            return list_windows(conn, self.registered(), self.pid)
        except Exception as exc:        # the connection broke (X server gone): start afresh next time
            log.debug("reading the window list failed: %s", exc)
            self.close_thread()
            return []

    def own_rects(self) -> list[Rect]:
        return [w.rect for w in self.windows() if w.is_own]

    def _connection(self):
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = open_display(self.display_name, "to list windows")
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


def open_display(display_name: str | None = None, why: str = ""):
    """A new Xlib connection to `display_name` (None = $DISPLAY), or None where there is no X display to open."""
    if not sys.platform.startswith("linux") or not (display_name or os.environ.get("DISPLAY")):
        return None
    try:
        from Xlib import display
        return display.Display(display_name)
    except Exception as exc:        # no X server, no python-xlib: nothing to read this time
        log.debug("cannot open the X display %s: %s", why, exc)
        return None


def list_windows(conn, own_ids: frozenset[int], pid: int) -> list[XWindow]:
    from Xlib import X
    from Xlib.error import XError
    pid_atom = conn.get_atom("_NET_WM_PID")
    root = conn.screen().root
    managed = _managed_ids(conn, root, X)
    found = []
    for window in root.query_tree().children:
        try:
            if window.get_attributes().map_state != X.IsViewable:
                continue
            geometry = window.get_geometry()
            children = window.query_tree().children
            # A frame's client is the child the window manager lists; only where it lists none (another
            # manager's layout, no manager) is every child read: a frame has tens of decoration children.
            clients = [window, *([c for c in children if c.id in managed] or children)]
            pids = [_pid_of(c, pid_atom, X) for c in clients]
            is_own = (any(c.id in own_ids for c in (window, *children))
                      or any(p == pid for p in pids))
            client, client_pid, title = next(((c, p, t) for c, p in zip(clients, pids)
                                              if (t := window_title(conn, c))), (None, None, ""))
            wm_class = window_class(client) if client is not None else ()
        except XError:                  # gone while we looked: not on screen any more
            continue
        found.append(XWindow(window.id, Rect(geometry.x, geometry.y, geometry.width, geometry.height), title,
                             is_own, wm_class, client_pid))
    return found


def _managed_ids(conn, root, X) -> frozenset[int]:
    """The client windows the window manager manages (`_NET_CLIENT_LIST`); empty without a manager."""
    prop = root.get_full_property(conn.get_atom("_NET_CLIENT_LIST"), X.AnyPropertyType)
    return frozenset(int(v) for v in prop.value) if prop is not None else frozenset()


def _pid_of(window, pid_atom, X) -> int | None:
    prop = window.get_full_property(pid_atom, X.AnyPropertyType)
    return int(prop.value[0]) if prop is not None and len(prop.value) else None


def window_pid(conn, window) -> int | None:
    """The window's _NET_WM_PID (the process that says it owns it), None when unset."""
    from Xlib import X
    return _pid_of(window, conn.get_atom("_NET_WM_PID"), X)


def window_class(window) -> tuple[str, ...]:
    """The window's WM_CLASS as (instance, class), () when unset."""
    return tuple(window.get_wm_class() or ())


def window_title(conn, window) -> str:
    """The window's _NET_WM_NAME (UTF-8), else WM_NAME, else "" (the reader privacy and window facts share)."""
    prop = window.get_full_property(conn.get_atom("_NET_WM_NAME"), conn.get_atom("UTF8_STRING"))   # atoms cached
    if prop is not None and prop.value:
        value = prop.value
        return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    name = window.get_wm_name()
    if isinstance(name, bytes):
        return name.decode("latin-1")
    return name or ""


def work_area() -> Rect | None:
    """The desktop's work area (`_NET_WORKAREA`: the screen less the panels), or None when unknown."""
    conn = open_display(why="to read the work area")
    if conn is None:
        return None
    from Xlib import X
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


def windows_in_region(region: Region, display_name: str | None = None) -> list[WindowFact]:
    """The windows that show in `region`, front first; [] when they cannot be known (no X display, an X error)."""
    conn = open_display(display_name, "for window facts")
    if conn is None:
        return []
    try:
        return _facts(conn, region)
    except Exception as exc:  # noqa: BLE001 - a window vanished mid-query, a broken property: no facts
        log.debug("Cannot read window facts: %s", exc)
        return []
    finally:
        conn.close()


def _facts(conn, region: Region) -> list[WindowFact]:
    from Xlib import X

    root = conn.screen().root
    focused = _focused_id(conn, root, X)
    facts = []
    for window in reversed(_stacking_bottom_to_top(conn, root, X)):       # front first
        fact = _fact(conn, root, window, region, focused)
        if fact is not None and not is_own_window(fact):
            facts.append(fact)
        if len(facts) == MAX_WINDOW_FACTS:
            break
    return visible(facts, region)


def _stacking_bottom_to_top(conn, root, X) -> list:
    prop = root.get_full_property(conn.intern_atom("_NET_CLIENT_LIST_STACKING"), X.AnyPropertyType)
    if prop is not None and len(prop.value):
        return [conn.create_resource_object("window", int(wid)) for wid in prop.value]
    mapped = []
    for child in root.query_tree().children:                # no window manager: the root's children
        attributes = child.get_attributes()
        if attributes.map_state == X.IsViewable and not attributes.override_redirect:
            mapped.append(child)
    return mapped


def _focused_id(conn, root, X) -> int | None:
    prop = root.get_full_property(conn.intern_atom("_NET_ACTIVE_WINDOW"), X.AnyPropertyType)
    if prop is not None and len(prop.value) and prop.value[0]:
        return int(prop.value[0])
    focus = conn.get_input_focus().focus
    return None if isinstance(focus, int) else focus.id


def _fact(conn, root, window, region: Region, focused: int | None) -> WindowFact | None:
    geometry = window.get_geometry()
    origin = window.translate_coords(root, 0, 0)
    left, top = -origin.x - region.left, -origin.y - region.top
    box = (left, top, left + geometry.width, top + geometry.height)
    frame = _frame_box(conn, root, window, region) or box
    if not shows_in(frame, region):
        return None
    title = window_title(conn, window)
    app = " ".join(window.get_wm_class() or ())
    return WindowFact(title[:200], app[:200], box, frame, window.id == focused)


def _frame_box(conn, root, window, region: Region) -> tuple[int, int, int, int] | None:
    """The top-level ancestor under the root (a reparenting window manager's frame), in region pixels."""
    current = window
    for _ in range(16):
        parent = current.query_tree().parent
        if not parent or isinstance(parent, int) or parent.id == root.id:
            break
        current = parent
    if current.id == window.id:
        return None
    geometry = current.get_geometry()
    return (geometry.x - region.left, geometry.y - region.top,
            geometry.x - region.left + geometry.width + 2 * geometry.border_width,
            geometry.y - region.top + geometry.height + 2 * geometry.border_width)
