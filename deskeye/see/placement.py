"""Where DeskEye's windows go, so that they never cover what DeskEye watches and stay on their monitor.

The overlay and the Ask box live in a *column* along one side of the monitor's work area (`overlay.position`: a corner
of `deskeye.settings.POSITIONS`; default bottom-right, away from the top-right corner where most notification daemons
show their bubbles). The default capture region is 800x600 centred on the monitor, kept inside the work area, moved
sideways (and narrowed if it must) so that it stays out of that column.

Sizes in the settings and here are logical pixels; `*_on(monitor, overlay)` turn them into the monitor's physical
pixels (deskeye/see/geometry.py `Monitor`), so at 192 dpi the default region is 1600x1200 and the overlay twice as
wide, as a person sees them at 96 dpi. The functions below those take physical pixels. Pure functions of rectangles:
no X, no Tk.
"""

from __future__ import annotations

import re

from deskeye.see.geometry import Monitor, Rect
from deskeye.settings import OverlaySettings

DEFAULT_REGION_SIZE = (800, 600)     # logical pixels


def overlay_column_on(monitor: Monitor, overlay: OverlaySettings) -> Rect:
    """The overlay's column on `monitor`, in its physical pixels."""
    return overlay_column(monitor.work_area, monitor.px(overlay.width_px), monitor.px(overlay.margin_px),
                          overlay.position)


def default_region_on(monitor: Monitor, overlay: OverlaySettings) -> Rect:
    """The default capture region on `monitor`: DEFAULT_REGION_SIZE logical pixels, out of the overlay's column."""
    size = (monitor.px(DEFAULT_REGION_SIZE[0]), monitor.px(DEFAULT_REGION_SIZE[1]))
    return default_region(monitor.rect, overlay_column_on(monitor, overlay), size=size, area=monitor.work_area)


def overlay_rect_on(monitor: Monitor, overlay: OverlaySettings, height_px: int) -> Rect:
    """The overlay's rectangle on `monitor`; `height_px` is what its content needs, in physical pixels."""
    return overlay_rect(monitor.work_area, monitor.px(overlay.width_px), height_px, monitor.px(overlay.margin_px),
                        overlay.position)


def ask_box_rect_on(monitor: Monitor, overlay: OverlaySettings, height_px: int, overlay_height_px: int) -> Rect:
    """The Ask box's rectangle on `monitor` (as wide as the overlay; `height_px` physical, what its content needs)."""
    return ask_box_rect(monitor.work_area, monitor.px(overlay.width_px), monitor.px(overlay.margin_px),
                        overlay.position, overlay_height_px, height_px)


def overlay_column(area: Rect, width_px: int, margin_px: int, position: str) -> Rect:
    """The strip of `area` the overlay and Ask box may use: their width plus a margin on each side."""
    width = min(width_px + 2 * margin_px, area.width)
    left = area.right - width if position.endswith("right") else area.left
    return Rect(left, area.top, width, area.height)


def overlay_rect(area: Rect, width_px: int, height_px: int, margin_px: int, position: str) -> Rect:
    """The overlay's rectangle in the chosen corner of `area`."""
    column = overlay_column(area, width_px, margin_px, position)
    height = min(height_px, area.height - 2 * margin_px)
    top = area.top + margin_px if position.startswith("top") else area.bottom - margin_px - height
    return Rect(column.left + margin_px, top, min(width_px, column.width), height)


def ask_box_rect(area: Rect, width_px: int, margin_px: int, position: str, overlay_height_px: int,
                 height_px: int) -> Rect:
    """The Ask box in the overlay's column, on the overlay's inner side (below a top overlay, above a bottom one),
    always inside `area` (over the overlay rather than off the monitor, where the area is too short for both)."""
    column = overlay_column(area, width_px, margin_px, position)
    width = min(width_px, column.width)
    height = min(height_px, area.height)
    gap = overlay_height_px + 2 * margin_px
    top = area.top + gap if position.startswith("top") else area.bottom - gap - height
    top = min(max(top, area.top), area.bottom - height)
    return Rect(column.left + (column.width - width) // 2, top, width, height)


def frame_extra(tk_geometry: str, root_x: int, root_y: int) -> tuple[int, int] | None:
    """How much wider and taller a window's frame (the window manager's title bar and borders) is than the window:
    Tk's `wm geometry` gives the frame's top-left corner, `winfo rootx/rooty` the window's own. None while the window
    has no frame (not yet framed, or no window manager); the bottom border is taken to be as wide as the sides."""
    match = re.fullmatch(r"\d+x\d+\+(-?\d+)\+(-?\d+)", tk_geometry)
    if match is None:
        return None
    border, title = root_x - int(match[1]), root_y - int(match[2])
    if border < 0 or title < 0 or (border, title) == (0, 0):
        return None
    return 2 * border, title + border


def default_region(monitor: Rect, column: Rect | None = None, *, size: tuple[int, int] = DEFAULT_REGION_SIZE,
                   area: Rect | None = None) -> Rect:
    """`size` (or `area`, if smaller) centred on the monitor, moved inside `area` (the work area; default: the
    monitor) and kept out of `column`."""
    area = area or monitor
    width, height = min(size[0], area.width), min(size[1], area.height)
    left = _inside(monitor.left + (monitor.width - width) // 2, width, area.left, area.right)
    top = _inside(monitor.top + (monitor.height - height) // 2, height, area.top, area.bottom)
    if column is None or not (left < column.right and column.left < left + width):
        return Rect(left, top, width, height)
    if column.left > area.left:                   # the column is on the right: end before it
        free = Rect(area.left, area.top, column.left - area.left, area.height)
    else:                                         # on the left: start after it
        free = Rect(column.right, area.top, area.right - column.right, area.height)
    margin = max(0, min(column.width // 8, (free.width - width) // 2))
    width = min(width, free.width - 2 * margin) if free.width > 2 * margin else free.width
    left = free.left + (free.width - width) // 2
    return Rect(left, top, max(width, 1), height)


def _inside(start: int, length: int, low: int, high: int) -> int:
    """`start` moved so that start..start+length lies within low..high (length fits)."""
    return max(low, min(start, high - length))
