"""Where the overlay, the Ask box and the default capture region go: never on top of each other."""

from __future__ import annotations

import pytest

from deskeye.see.geometry import Monitor, Rect
from deskeye.see.monitors import physical_dpi, scale_for, strut_rects, work_area, xft_dpi
from deskeye.see.placement import (ask_box_rect, default_region, default_region_on, frame_extra,
                                   overlay_column, overlay_column_on, overlay_rect, overlay_rect_on)
from deskeye.settings import POSITIONS, OverlaySettings

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
        ask_box = ask_box_rect(monitor, o.width_px, o.margin_px, position, overlay_height, 80)
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


# ------------------------------------------------------------------ logical pixels, per-monitor work areas

@pytest.mark.parametrize("scale", [1.0, 1.5, 2.0])
def test_sizes_are_logical_pixels_times_the_monitor_scale(scale):
    rect = Rect(0, 0, 3840, 2160)
    monitor = Monitor(rect, rect, scale)
    o = OverlaySettings()
    region = default_region_on(monitor, o)
    assert (region.width, region.height) == (800 * scale, 600 * scale)
    assert abs(2 * region.left + region.width - rect.width) <= 1 and abs(2 * region.top + region.height - rect.height) <= 1
    overlay = overlay_rect_on(monitor, o, 100)
    assert overlay.width == 420 * scale and overlay.right == rect.right - 16 * scale
    assert not overlay.intersects(region)
    assert not overlay_column_on(monitor, o).intersects(region)


@pytest.mark.parametrize("position", POSITIONS)
def test_the_ask_box_stays_inside_the_area_even_when_it_is_short(position):
    area = Rect(1920, 0, 1280, 300)
    for overlay_height in (40, 200, 280):
        box = ask_box_rect(area, 840, 32, position, overlay_height, 150)
        assert area.clip(box) == box, (position, overlay_height, box)
    roomy = ask_box_rect(Rect(0, 0, 1920, 1080), 420, 16, position, 100, 90)
    overlay = overlay_rect(Rect(0, 0, 1920, 1080), 420, 100, 16, position)
    assert not roomy.intersects(overlay)


def test_a_panel_on_one_monitor_leaves_the_other_whole():
    screen_w, screen_h = 3200, 1080
    left_monitor, right_monitor = Rect(0, 0, 1920, 1080), Rect(1920, 0, 1280, 1024)
    # a 72-px panel along the bottom of the right monitor (its strut counts from the X screen's bottom: 56 + 72)
    bottom_panel = strut_rects([0, 0, 0, 128, 0, 0, 0, 0, 0, 0, 1920, 3199], screen_w, screen_h)
    assert work_area(left_monitor, bottom_panel) == left_monitor
    assert work_area(right_monitor, bottom_panel) == Rect(1920, 0, 1280, 952)
    # a panel along the left edge of the right monitor: on the left one it is interior, not an edge
    left_panel = strut_rects([1960, 0, 0, 0, 0, 1023, 0, 0, 0, 0, 0, 0], screen_w, screen_h)
    assert work_area(left_monitor, left_panel) == left_monitor
    assert work_area(right_monitor, left_panel) == Rect(1960, 0, 1240, 1024)
    # _NET_WM_STRUT (no partial): the whole top edge
    assert work_area(left_monitor, strut_rects([0, 0, 24, 0], screen_w, screen_h)) == Rect(0, 24, 1920, 1056)


def test_the_scale_comes_from_xft_dpi_else_the_physical_size():
    assert xft_dpi("Xcursor.size:\t24\nXft.dpi:\t144\n") == 144.0
    assert xft_dpi("Xft.dpi: lots\n") is None and xft_dpi("") is None
    assert scale_for(144.0, physical_dpi((1920, 508, 286))) == 1.5         # the desktop's choice wins
    assert scale_for(None, physical_dpi((3840, 508, 286))) == 2.0          # a 4K 23" monitor
    assert scale_for(None, physical_dpi((1920, 518, 324))) == 1.0          # 94 dpi rounds to 1
    assert scale_for(None, physical_dpi((1920, 16, 9))) == 1.0             # an EDID placeholder is no size
    assert scale_for(72.0, None) == 1.0 and scale_for(None, None) == 1.0   # never below 1


def test_the_frame_a_window_manager_adds_is_read_from_tk_geometry():
    assert frame_extra("420x87+1484+904", 1485, 925) == (2, 22)       # openbox: 1-px border, 20-px title bar
    assert frame_extra("420x87+1484+904", 1484, 904) is None          # not framed (yet)
    assert frame_extra("420x87+-4+10", 0, 30) == (8, 24)
    assert frame_extra("1x1+0+0", 0, 0) is None and frame_extra("garbage", 0, 0) is None
