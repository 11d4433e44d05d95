"""The overlay window on a real X server (Xvfb): placement, content, fading, focus, staying on top, Ask…"""

from __future__ import annotations

import subprocess
import threading
import time

import pytest

from deskeye.see.capture import ScreenGrabber
from deskeye.ui.ask_box import ASK_TITLE
from deskeye.ui.overlay import THINKING_TEXT, WINDOW_TITLE, Kind, Overlay, OverlayContent
from deskeye.see.x11_windows import OwnWindows
from deskeye.settings import CaptureSettings, OverlaySettings
from tests.fixtures.polling import wait_until

pytestmark = [pytest.mark.desktop, pytest.mark.subprocess]

OVERLAY_BG = (0x1F, 0x24, 0x30)     # the "answer" background colour


def xdotool(*args: str) -> str:
    done = subprocess.run(["xdotool", *args], capture_output=True, text=True, timeout=10)
    return done.stdout.strip()


def xwininfo(window_id: str) -> dict[str, str]:
    out = subprocess.run(["xwininfo", "-id", window_id], capture_output=True, text=True, timeout=10).stdout
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines()) if v}


def overlay_window_id() -> str:
    ids = wait_until(lambda: xdotool("search", "--onlyvisible", "--name", WINDOW_TITLE))
    assert ids, "the overlay window is not mapped"
    return ids.split()[0]


@pytest.fixture
def overlay(xdisplay):
    ov = Overlay(OverlaySettings(fade_after_s=0, margin_px=16, width_px=420, position="top-right"))
    ov.start()
    yield ov
    ov.stop()
    assert not ov.is_running


@pytest.mark.slow
def test_answer_shows_at_the_top_right_with_summary_and_key_objects(xdisplay, overlay):
    overlay.show(OverlayContent(Kind.ANSWER, "A text editor with a shopping list", ["shopping list", "milk"]))
    shown = overlay.wait_for(lambda s: s is not None and s.kind == "answer", 5)
    assert shown.summary == "A text editor with a shopping list"
    assert shown.key_objects == ("shopping list", "milk")
    info = xwininfo(overlay_window_id())
    assert int(info["Width"]) == 420
    assert int(info["Absolute upper-left X"]) + 420 + 16 == xdisplay.width
    assert int(info["Absolute upper-left Y"]) == 16
    assert info["Map State"] == "IsViewable" and info["Override Redirect State"] == "yes"

    overlay.show(OverlayContent(Kind.THINKING, THINKING_TEXT))
    assert overlay.wait_for(lambda s: s and s.kind == "thinking", 5).summary == THINKING_TEXT
    overlay.hide()
    assert overlay.wait_for(lambda s: s is None, 5) is None
    assert wait_until(lambda: not xdotool("search", "--onlyvisible", "--name", WINDOW_TITLE))


@pytest.mark.slow
def test_the_answer_fades_after_the_configured_time(xdisplay):
    ov = Overlay(OverlaySettings(fade_after_s=0.5))
    ov.start()
    try:
        ov.show(OverlayContent(Kind.ANSWER, "fading answer"))
        assert ov.wait_for(lambda s: s is not None, 5).summary == "fading answer"
        shown_at = time.monotonic()
        assert ov.wait_for(lambda s: s is None, 5) is None
        assert time.monotonic() - shown_at >= 0.4
        assert wait_until(lambda: not xdotool("search", "--onlyvisible", "--name", WINDOW_TITLE))
        ov.show(OverlayContent(Kind.THINKING, THINKING_TEXT))                         # "thinking…" stays until the answer comes
        time.sleep(1.0)
        assert ov.shown is not None and ov.shown.kind == "thinking"
    finally:
        ov.stop()


@pytest.mark.slow
def test_showing_the_overlay_never_takes_keyboard_focus(xdisplay, overlay, open_window):
    editor = open_window("Editor - notes.txt", "500x300+100+100", lines=["typing here"])
    editor.focus()
    assert xdotool("getwindowfocus", "getwindowname") == "Editor - notes.txt"
    for i in range(3):
        overlay.show(OverlayContent(Kind.ANSWER, f"answer {i}", ["x"]))
        overlay.wait_for(lambda s, i=i: s is not None and s.summary == f"answer {i}", 5)
        overlay_window_id()
        time.sleep(0.2)
        assert xdotool("getwindowfocus", "getwindowname") == "Editor - notes.txt"


@pytest.mark.slow
def test_the_overlay_is_lifted_above_a_window_opened_later(xdisplay, overlay, open_window):
    overlay.show(OverlayContent(Kind.ANSWER, "stays on top"))
    overlay_window_id()
    grabber = ScreenGrabber(CaptureSettings(region=f"{xdisplay.width - 16 - 400},20,8,8"))   # no masking here
    assert wait_until(lambda: grabber.grab().image.getpixel((0, 0)) == OVERLAY_BG)
    # A window opened on top of the overlay's corner, after it was shown (blocks are magenta).
    open_window("newcomer", f"600x200+{xdisplay.width - 700}+0", blocks=[(0, 0, 600, 200, "#ff00ff")])
    assert wait_until(lambda: grabber.grab().image.getpixel((0, 0)) == OVERLAY_BG, timeout_s=3.0)
    grabber.close_thread()


@pytest.mark.slow
def test_ask_dialog_takes_a_typed_question(xdisplay, overlay):
    asked: list[str] = []
    got = threading.Event()
    overlay.open_ask_dialog(lambda q: (asked.append(q), got.set()))
    dialog = wait_until(lambda: xdotool("search", "--onlyvisible", "--name", ASK_TITLE))
    assert dialog
    assert wait_until(lambda: xdotool("getwindowfocus", "getwindowname") == ASK_TITLE)
    subprocess.run(["xdotool", "type", "--delay", "5", "what time is it"], check=True, timeout=20)
    subprocess.run(["xdotool", "key", "Return"], check=True, timeout=10)
    assert got.wait(5)
    assert asked == ["what time is it"]
    assert wait_until(lambda: not xdotool("search", "--onlyvisible", "--name", ASK_TITLE))


@pytest.mark.slow
def test_by_default_the_overlay_sits_bottom_right_and_a_streamed_answer_grows_in_place(xdisplay):
    own = OwnWindows()
    ov = Overlay(OverlaySettings(fade_after_s=0), own_windows=own)
    ov.start()
    try:
        for text in ("The", "The screen shows", "The screen shows a terminal with a traceback"):
            ov.show(OverlayContent(Kind.ANSWER, text))
            assert ov.wait_for(lambda s, t=text: s is not None and s.summary == t, 5)
        info = xwininfo(overlay_window_id())
        left, top = int(info["Absolute upper-left X"]), int(info["Absolute upper-left Y"])
        assert left + 420 + 16 == xdisplay.width
        assert top + int(info["Height"]) + 16 == xdisplay.height
        assert wait_until(lambda: [(r.left, r.top) for r in own.own_rects()] == [(left, top)])
    finally:
        ov.stop()
        own.close_thread()


@pytest.mark.slow
def test_escape_closes_the_ask_box_without_asking(xdisplay, overlay):
    asked: list[str] = []
    overlay.open_ask_dialog(asked.append)
    assert wait_until(lambda: xdotool("getwindowfocus", "getwindowname") == ASK_TITLE)
    subprocess.run(["xdotool", "type", "--delay", "5", "never sent"], check=True, timeout=20)
    subprocess.run(["xdotool", "key", "Escape"], check=True, timeout=10)
    assert wait_until(lambda: not xdotool("search", "--onlyvisible", "--name", ASK_TITLE))
    time.sleep(0.3)
    assert asked == []
