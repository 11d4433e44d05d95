"""Meaningful change (deskeye/see/change.py) and masking of DeskEye's own windows (deskeye/see/capture.py) on a real
X server: a real Tk overlay, Ask box and menu over the watched region, real mss grabs."""

from __future__ import annotations

import pytest

import subprocess

from PIL import Image, ImageDraw

from deskeye.see.capture import MASK_COLOUR, ScreenGrabber
from deskeye.see.change import Change, ChangeDetector
from deskeye.ui.menu import MenuActions
from deskeye.ui.ask_box import ASK_TITLE
from deskeye.ui.overlay import Kind, Overlay, OverlayContent
from deskeye.settings import CaptureSettings, OverlaySettings
from deskeye.see.x11_windows import OwnWindows
from tests.fixtures.polling import wait_until

pytestmark = [pytest.mark.desktop, pytest.mark.subprocess]


def screen(lines: list[str], clock: str = "", size=(800, 600)) -> Image.Image:
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    for i, text in enumerate(lines):
        draw.text((20, 20 + 40 * i), text, fill="black", font_size=28)
    if clock:
        draw.text((700, 560), clock, fill="black", font_size=14)
    return image


def test_a_changed_line_is_major_a_ticking_clock_is_minor_and_waits_its_interval():
    now = [0.0]
    detector = ChangeDetector(12, min_changed_percent=0.8, small_change_interval_s=60, clock=lambda: now[0])
    first = screen(["Quarterly report", "Costs are under review"], clock="10:00:01")
    assert detector.classify(first) is Change.MAJOR and detector.should_describe(first)   # nothing described yet
    detector.mark_described(first)
    assert detector.classify(first) is Change.NONE
    ticked = screen(["Quarterly report", "Costs are under review"], clock="10:00:02")
    assert detector.classify(ticked) is Change.MINOR
    now[0] = 59.0
    assert not detector.should_describe(ticked)
    now[0] = 60.0
    assert detector.should_describe(ticked)                  # once a minute, at most
    changed = screen(["Quarterly report", "Costs were cut by a third"], clock="10:00:01")
    now[0] = 1.0
    assert detector.classify(changed) is Change.MAJOR and detector.should_describe(changed)


def test_small_changes_never_describe_on_their_own_when_the_interval_is_zero():
    detector = ChangeDetector(12, small_change_interval_s=0, clock=lambda: 1e9)
    detector.mark_described(screen(["x"], clock="10:00:01"))
    assert detector.classify(screen(["x"], clock="10:59:58")) is Change.MINOR
    assert not detector.should_describe(screen(["x"], clock="10:59:58"))


def xdotool(*args: str) -> str:
    return subprocess.run(["xdotool", *args], capture_output=True, text=True, timeout=10).stdout.strip()


@pytest.mark.slow
def test_the_overlay_ask_box_and_menu_are_masked_out_of_frames_wherever_they_are(xdisplay, open_window):
    open_window("Report", "800x600+100+100", lines=["Quarterly report draft", "Costs are under review"])
    own = OwnWindows()
    grabber = ScreenGrabber(CaptureSettings(region="100,100,800,600"), mask=own.own_rects)
    # The overlay placed right inside the watched region (the default placement never does this).
    overlay = Overlay(OverlaySettings(fade_after_s=0, position="top-left", margin_px=150), own_windows=own,
                      menu_actions=MenuActions())
    overlay.start()
    try:
        detector = ChangeDetector(12)
        before = grabber.grab()
        assert before.masked == ()
        detector.mark_described(before.image, before.masks)
        overlay.show(OverlayContent(Kind.ANSWER, "A report about costs", ("report",)))
        assert overlay.wait_for(lambda s: s is not None, 5)
        frame = wait_until(lambda: (f := grabber.grab()).masked and f, 5)
        assert frame, "the overlay was not masked"
        [mask] = frame.masked
        assert (mask.left, mask.top) == (150, 150)                       # where the overlay is
        inside = (mask.left - 100 + 5, mask.top - 100 + 5)
        assert frame.image.getpixel(inside) == MASK_COLOUR
        assert detector.classify(frame.image, frame.masks) is Change.NONE   # the overlay is no change
        overlay.open_ask_dialog(lambda question: None)
        assert wait_until(lambda: xdotool("search", "--onlyvisible", "--name", ASK_TITLE), 5)
        assert wait_until(lambda: len(grabber.grab().masked) == 2, 5)    # the Ask box too
        overlay.call_in_tk(lambda: overlay._popup_menu(400, 400))         # what a right-click does
        assert wait_until(lambda: len(grabber.grab().masked) == 3, 5)    # and the menu
        xdotool("key", "Escape")
    finally:
        overlay.stop()
        grabber.close_thread()
        own.close_thread()
