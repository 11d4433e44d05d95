"""Each monitor's scale and work area, read from the X server: what DeskEye needs to lay out its windows and the
default region in logical pixels, on the part of the monitor the panels leave.

Scale (physical pixels per logical pixel) = the DPI / 96. The DPI is the desktop's `Xft.dpi` X resource (what Xfce,
GNOME, KDE and `xrdb` set when the user picks a scale: it holds for every monitor), else the RandR monitor's physical
size (its EDID, rounded to a quarter step, so a 94-dpi monitor stays at 1), else 96. Never below 1: the default region
is at least the 800x600 physical pixels the models were tuned on.

The work area is per monitor: the monitor less the struts (`_NET_WM_STRUT_PARTIAL`, else `_NET_WM_STRUT`) of the
panels docked on it. `_NET_WORKAREA` is one rectangle for the whole X screen, so a panel on one monitor would move
DeskEye's windows on the other. A strut counts on a monitor only where it lies along that monitor's edge (EWMH
struts are measured from the X screen's edges, so a panel between two monitors would otherwise swallow one of them).
"""

from __future__ import annotations

import logging
from typing import Iterator

from deskeye.see.geometry import Monitor, Rect
from deskeye.see.x11_windows import open_display

log = logging.getLogger(__name__)

BASE_DPI = 96.0                   # scale 1
MIN_SCALE, MAX_SCALE = 1.0, 4.0
SCALE_STEP = 0.25                 # a DPI from the physical size is rounded to this (EDID sizes are approximate)
MIN_PHYSICAL_MM = (100, 60)       # an EDID size below this is a placeholder (16x9 "cm", 0x0), not a monitor's size
EDGES = ("left", "right", "top", "bottom")

Strut = tuple[str, Rect]          # the edge a panel is docked on, and the root-window rectangle it reserves


def desktop_monitors() -> list[Rect]:
    """The monitors as the X server ($DISPLAY) lays them out, in mss numbering ([0] all of them, [1] the first, then
    the others): on Wayland, Xwayland's view of the compositor's layout (its logical pixels, measured on sway 1.7), the
    pixels DeskEye's windows are placed in. [] where there is no X display to ask."""
    import os
    if not os.environ.get("DISPLAY"):
        return []
    try:
        import mss
        with mss.MSS() as sct:
            return [Rect(m["left"], m["top"], m["width"], m["height"]) for m in sct.monitors]
    except Exception as exc:  # noqa: BLE001 - no X server, no mss: the monitors are unknown
        log.debug("cannot list the X server's monitors: %s", exc)
        return []


def read_monitor(rect: Rect, display_name: str | None = None) -> Monitor:
    """The monitor at `rect` (physical pixels, e.g. from mss) with its scale and work area; scale 1 and no panels
    where the X server cannot be asked."""
    conn = open_display(display_name, "to read the monitors")
    if conn is None:
        return Monitor(rect, rect)
    try:
        screen = conn.screen()
        root = screen.root
        scale = scale_for(xft_dpi(_resources(root)), physical_dpi(_randr_monitor(root, rect)))
        struts = list(_struts(conn, root, screen.width_in_pixels, screen.height_in_pixels))
        return Monitor(rect, work_area(rect, struts), scale)
    except Exception as exc:  # noqa: BLE001 - a window vanished mid-read, an old server: lay out at scale 1
        log.debug("cannot read the monitor's scale and panels: %s", exc)
        return Monitor(rect, rect)
    finally:
        conn.close()


def scale_for(xft: float | None, physical: float | None) -> float:
    """The scale from the desktop's Xft.dpi (exact: the user chose it), else from the physical DPI (rounded to
    SCALE_STEP), else 1; within MIN_SCALE..MAX_SCALE."""
    if xft is not None:
        scale = xft / BASE_DPI
    elif physical is not None:
        scale = round(physical / BASE_DPI / SCALE_STEP) * SCALE_STEP
    else:
        scale = MIN_SCALE
    return min(max(scale, MIN_SCALE), MAX_SCALE)


def xft_dpi(resources: str) -> float | None:
    """`Xft.dpi` from the X resources' text (the RESOURCE_MANAGER property), None when unset or not a number."""
    for line in resources.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Xft.dpi":
            try:
                dpi = float(value.strip())
            except ValueError:
                return None
            return dpi if dpi > 0 else None
    return None


def physical_dpi(monitor: tuple[int, int, int] | None) -> float | None:
    """The DPI of a monitor (width in pixels, width and height in millimetres), None when the size is unknown."""
    if monitor is None:
        return None
    width_px, width_mm, height_mm = monitor
    if width_mm < MIN_PHYSICAL_MM[0] or height_mm < MIN_PHYSICAL_MM[1]:
        return None
    return width_px * 25.4 / width_mm


def strut_rects(values: list[int], screen_width: int, screen_height: int) -> list[Strut]:
    """The rectangles a panel reserves, from its _NET_WM_STRUT_PARTIAL (12 values) or _NET_WM_STRUT (4: whole edges)."""
    if len(values) < 4:
        return []
    left, right, top, bottom = values[:4]
    if len(values) >= 12:
        left_y0, left_y1, right_y0, right_y1, top_x0, top_x1, bottom_x0, bottom_x1 = values[4:12]
    else:
        left_y0 = right_y0 = top_x0 = bottom_x0 = 0
        left_y1, right_y1, top_x1, bottom_x1 = screen_height - 1, screen_height - 1, screen_width - 1, screen_width - 1
    rects = (Rect(0, left_y0, left, left_y1 - left_y0 + 1),
             Rect(screen_width - right, right_y0, right, right_y1 - right_y0 + 1),
             Rect(top_x0, 0, top_x1 - top_x0 + 1, top),
             Rect(bottom_x0, screen_height - bottom, bottom_x1 - bottom_x0 + 1, bottom))
    return [(edge, rect) for edge, rect in zip(EDGES, rects) if rect.width > 0 and rect.height > 0]


def work_area(monitor: Rect, struts: list[Strut]) -> Rect:
    """`monitor` less the struts that lie along its edges (a strut that covers the whole monitor, or none of its
    edge, belongs to another monitor)."""
    left, top, right, bottom = monitor.left, monitor.top, monitor.right, monitor.bottom
    for edge, rect in struts:
        part = monitor.clip(rect)
        if part is None or part == monitor:
            continue
        if edge == "left" and part.left == monitor.left and part.right < monitor.right:
            left = max(left, part.right)
        elif edge == "right" and part.right == monitor.right and part.left > monitor.left:
            right = min(right, part.left)
        elif edge == "top" and part.top == monitor.top and part.bottom < monitor.bottom:
            top = max(top, part.bottom)
        elif edge == "bottom" and part.bottom == monitor.bottom and part.top > monitor.top:
            bottom = min(bottom, part.top)
    if right <= left or bottom <= top:              # panels on every side of a tiny monitor: keep it whole
        return monitor
    return Rect(left, top, right - left, bottom - top)


def _resources(root) -> str:
    from Xlib import Xatom
    prop = root.get_full_property(Xatom.RESOURCE_MANAGER, Xatom.STRING)
    if prop is None:
        return ""
    value = prop.value
    return value.decode("latin-1") if isinstance(value, bytes) else str(value)


def _randr_monitor(root, rect: Rect) -> tuple[int, int, int] | None:
    """(width px, width mm, height mm) of the RandR monitor at `rect` (else the one holding its centre)."""
    if not hasattr(root, "xrandr_get_monitors"):          # RandR before 1.5: no monitors to ask
        return None
    monitors = root.xrandr_get_monitors(True).monitors
    centre = (rect.left + rect.width // 2, rect.top + rect.height // 2)

    def where(m) -> Rect:
        return Rect(m.x, m.y, m.width_in_pixels, m.height_in_pixels)
    chosen = (next((m for m in monitors if where(m) == rect), None)
              or next((m for m in monitors if where(m).clip(Rect(*centre, 1, 1))), None))
    if chosen is None:
        return None
    return chosen.width_in_pixels, chosen.width_in_millimeters, chosen.height_in_millimeters


def _struts(conn, root, screen_width: int, screen_height: int) -> Iterator[Strut]:
    """The struts of the windows that may be panels: the window manager's clients (docks are among them), else, with
    no window manager, every mapped top-level window."""
    from Xlib import X
    from Xlib.error import XError
    partial, full = conn.intern_atom("_NET_WM_STRUT_PARTIAL"), conn.intern_atom("_NET_WM_STRUT")
    for window in _panel_candidates(conn, root, X):
        try:
            values = _cardinals(window, partial, X) or _cardinals(window, full, X)
        except XError:                                  # gone while we looked
            continue
        yield from strut_rects(values, screen_width, screen_height)


def _panel_candidates(conn, root, X) -> list:
    from Xlib.error import XError
    clients = root.get_full_property(conn.intern_atom("_NET_CLIENT_LIST"), X.AnyPropertyType)
    if clients is not None and len(clients.value):
        return [conn.create_resource_object("window", int(wid)) for wid in clients.value]
    mapped = []
    for child in root.query_tree().children:
        try:
            if child.get_attributes().map_state == X.IsViewable:
                mapped.append(child)
        except XError:
            continue
    return mapped


def _cardinals(window, atom: int, X) -> list[int]:
    prop = window.get_full_property(atom, X.AnyPropertyType)
    return [int(v) for v in prop.value] if prop is not None and prop.format == 32 else []
