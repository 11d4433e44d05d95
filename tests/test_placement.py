"""Where the overlay, the Ask box and the default capture region go: never on top of each other."""

from __future__ import annotations

import pytest

from deskeye.geometry import Rect
from deskeye.placement import POSITIONS, ask_box_origin, default_region, overlay_column, overlay_rect
from deskeye.settings import OverlaySettings

SIZES = [(1280, 800), (1366, 768), (1600, 900), (1920, 1080), (2560, 1440)]
MAX_OVERLAY_HEIGHT_PX = 400            # a long answer with key objects


@pytest.mark.parametrize("width, height", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
@pytest.mark.parametrize("position", POSITIONS)
def test_default_region_overlay_and_ask_box_never_overlap(width, height, position):
    o = OverlaySettings(position=position)
    monitor = Rect(0, 0, width, height)
    region = default_region(monitor, overlay_column(monitor, o.width_px, o.margin_px, position))
    assert region.width == 800 and region.height == 600             # the documented default size still fits
    assert monitor.clip(region) == region                           # on the monitor
    for overlay_height in (40, 120, MAX_OVERLAY_HEIGHT_PX):
        overlay = overlay_rect(monitor, o.width_px, overlay_height, o.margin_px, position)
        assert not overlay.intersects(region), (overlay, region)
        x, y = ask_box_origin(monitor, o.width_px, o.margin_px, position, overlay_height)
        ask_box = Rect(x, y, o.width_px, 80)
        assert not ask_box.intersects(region)
    assert abs((region.top + region.bottom) / 2 - height / 2) <= 1  # still centred vertically


def test_where_the_overlay_fits_beside_it_the_region_stays_centred():
    monitor = Rect(0, 0, 1920, 1080)
    column = overlay_column(monitor, 420, 16, "bottom-right")
    assert default_region(monitor, column) == Rect(560, 240, 800, 600)


def test_a_monitor_too_narrow_for_both_narrows_the_region_instead_of_overlapping():
    monitor = Rect(0, 0, 1024, 768)
    column = overlay_column(monitor, 420, 16, "top-right")
    region = default_region(monitor, column)
    assert region.right <= column.left and region.width < 800


def test_overlay_position_is_validated():
    with pytest.raises(Exception, match=r"overlay.position: invalid value 'middle'; allowed: bottom-right"):
        OverlaySettings(position="middle")
