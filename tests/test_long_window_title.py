"""A window title of megabytes (any program can set one) on a real X server (Xvfb): it is still matched whole by
the privacy check, but what the user sees, the privacy notice and the overlay, is cut to a few hundred characters."""

from __future__ import annotations

import pytest

from deskeye.see.geometry import Rect
from deskeye.ui.overlay import Kind, Overlay, OverlayContent
from deskeye.see.privacy import active_window_title, check_privacy
from deskeye.settings import OverlaySettings
from deskeye.see.x11_windows import OwnWindows

pytestmark = [pytest.mark.desktop]

TITLE_BYTES = 4 * 1024 * 1024
CHUNK_BYTES = 64 * 1024               # each ChangeProperty request stays well under the core protocol's limit
EXCLUDED = "Private Browsing"
MAX_NOTICE_CHARS = 600               # a notice the user can read: the sentence and a title cut to a few hundred
MAX_OVERLAY_CHARS = 2000             # what fits in the overlay at its widest
MAX_OBJECT_CHARS = 100


@pytest.fixture
def long_title_window(xdisplay):
    """A mapped, focused top-level X window whose _NET_WM_NAME is 4 MB ending in an excluded entry; yields its
    title and screen rectangle."""
    from Xlib import X, display
    conn = display.Display(xdisplay.name)
    screen = conn.screen()
    rect = Rect(300, 300, 320, 200)
    window = screen.root.create_window(rect.left, rect.top, rect.width, rect.height, 0, screen.root_depth,
                                       X.InputOutput, X.CopyFromParent, background_pixel=screen.white_pixel,
                                       override_redirect=True)
    title = ("Ünïcode tab\there " + "x" * TITLE_BYTES)[:TITLE_BYTES - len(EXCLUDED) - 3] + " — " + EXCLUDED
    data = title.encode("utf-8")
    name, utf8 = conn.intern_atom("_NET_WM_NAME"), conn.intern_atom("UTF8_STRING")
    for start in range(0, len(data), CHUNK_BYTES):
        window.change_property(name, utf8, 8, data[start:start + CHUNK_BYTES],
                               mode=X.PropModeReplace if start == 0 else X.PropModeAppend)
    window.map()
    conn.sync()
    window.set_input_focus(X.RevertToPointerRoot, X.CurrentTime)
    conn.sync()
    try:
        yield title, rect
    finally:
        window.destroy()
        conn.sync()
        conn.close()


def test_the_privacy_notice_shows_a_4mb_title_cut_to_a_few_hundred_characters(long_title_window):
    title, rect = long_title_window
    assert len(title.encode("utf-8")) >= TITLE_BYTES - 8
    assert active_window_title() == title               # read whole from the X server: matched whole

    verdict = check_privacy([EXCLUDED])
    assert verdict.is_excluded and verdict.matched == EXCLUDED
    assert len(verdict.reason) <= MAX_NOTICE_CHARS, len(verdict.reason)
    assert verdict.reason.startswith("DeskEye is not looking: the active window ('Ünïcode tab here xxx")
    assert "…'" in verdict.reason and "\t" not in verdict.reason
    assert verdict.reason.endswith(f"matches the exclusion entry {EXCLUDED!r}. Nothing was captured or sent.")

    in_region = check_privacy([EXCLUDED], lambda: None, region=rect, windows=OwnWindows().windows())
    assert in_region.is_excluded and in_region.where == "a window in the watched region"
    assert len(in_region.reason) <= MAX_NOTICE_CHARS, len(in_region.reason)


def test_the_overlay_shows_the_notice_and_any_huge_text_bounded(xdisplay, long_title_window):
    title, _ = long_title_window
    overlay = Overlay(OverlaySettings(fade_after_s=0))
    overlay.start()
    try:
        notice = check_privacy([EXCLUDED]).reason
        overlay.show(OverlayContent(Kind.NOTICE, notice))
        shown = overlay.wait_for(lambda s: s is not None and s.kind == "notice", 20)
        assert shown is not None and shown.summary == notice

        overlay.show(OverlayContent(Kind.ERROR, title, [title, "ok"]))     # text from the screen, not cut upstream
        shown = overlay.wait_for(lambda s: s is not None and s.kind == "error", 20)
        assert shown is not None, "the overlay did not show the text within 20 s"
        assert len(shown.summary) <= MAX_OVERLAY_CHARS and shown.summary.endswith("…")
        assert title.startswith(shown.summary[:-1])
        assert len(shown.key_objects) == 2 and shown.key_objects[1] == "ok"
        assert len(shown.key_objects[0]) <= MAX_OBJECT_CHARS and shown.key_objects[0].endswith("…")
    finally:
        overlay.stop()
