"""Where DeskEye's windows go, so that they never cover what DeskEye watches.

The overlay and the Ask box live in a *column* along one side of the monitor (`overlay.position`: a corner;
default bottom-right, away from the top-right corner where most notification daemons show their bubbles).
The default capture region is 800x600 centred on the monitor, moved sideways (and narrowed if it must) so
that it stays out of that column. Pure functions of rectangles: no X, no Tk.
"""

from __future__ import annotations

from deskeye.geometry import Rect

POSITIONS = ("bottom-right", "top-right", "bottom-left", "top-left")
DEFAULT_REGION_SIZE = (800, 600)
ASK_BOX_HEIGHT_PX = 90         # room kept above (or below) the overlay for the Ask box


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


def ask_box_origin(area: Rect, width_px: int, margin_px: int, position: str, overlay_height_px: int) -> tuple[int, int]:
    """Top-left corner of the Ask box: in the overlay's column, just inside the overlay's corner."""
    column = overlay_column(area, width_px, margin_px, position)
    gap = overlay_height_px + 2 * margin_px
    if position.startswith("top"):
        return column.left + margin_px, area.top + gap
    return column.left + margin_px, max(area.top, area.bottom - gap - ASK_BOX_HEIGHT_PX)


def default_region(monitor: Rect, column: Rect | None = None) -> Rect:
    """800x600 (or the monitor, if smaller) centred on the monitor, kept out of `column`."""
    width, height = min(DEFAULT_REGION_SIZE[0], monitor.width), min(DEFAULT_REGION_SIZE[1], monitor.height)
    left = monitor.left + (monitor.width - width) // 2
    top = monitor.top + (monitor.height - height) // 2
    if column is None or not (left < column.right and column.left < left + width):
        return Rect(left, top, width, height)
    if column.left > monitor.left:                # the column is on the right: end before it
        free = Rect(monitor.left, monitor.top, column.left - monitor.left, monitor.height)
    else:                                         # on the left: start after it
        free = Rect(column.right, monitor.top, monitor.right - column.right, monitor.height)
    margin = max(0, min(column.width // 8, (free.width - width) // 2))
    width = min(width, free.width - 2 * margin) if free.width > 2 * margin else free.width
    left = free.left + (free.width - width) // 2
    return Rect(left, top, max(width, 1), height)
