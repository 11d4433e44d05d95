"""Screen capture, change detection and the privacy check on a real X server (Xvfb) with real windows; the session
deciding the capture backend, and a black grab refused where the screen is not known to be black."""

from __future__ import annotations

import io
import threading
import time

import pytest
from PIL import Image

from deskeye.see.capture import Rect, ScreenGrabber, grab_png, is_black, resolve_region
from deskeye.see.change import ChangeDetector
from deskeye.errors import CaptureError, SettingsError
from deskeye.see.privacy import active_window_title, check_privacy, matching_exclusion
from deskeye.see.session import Session, SessionType
from deskeye.settings import CaptureSettings, Settings

pytestmark = [pytest.mark.desktop]

# 400x300 window at (560, 240): the top-left of the default 800x600 region centred on 1920x1080.
BLOCKS = [(0, 0, 200, 150, "#ff0000"), (200, 0, 200, 150, "#00ff00"),
          (0, 150, 200, 150, "#0000ff"), (200, 150, 200, 150, "#ffff00")]
BLOCK_RGB = {"#ff0000": (255, 0, 0), "#00ff00": (0, 255, 0), "#0000ff": (0, 0, 255), "#ffff00": (255, 255, 0)}


def expected_blocks() -> Image.Image:
    image = Image.new("RGB", (400, 300))
    for x, y, w, h, colour in BLOCKS:
        image.paste(BLOCK_RGB[colour], (x, y, x + w, y + h))
    return image


def grab_until(grabber: ScreenGrabber, predicate, timeout_s: float = 3.0) -> Image.Image:
    deadline = time.monotonic() + timeout_s
    image = grabber.grab().image
    while not predicate(image) and time.monotonic() < deadline:
        time.sleep(0.05)
        image = grabber.grab().image
    return image


def test_grab_has_the_exact_pixels_of_a_window_drawn_there(xdisplay, open_window):
    open_window("blocks", "400x300+560+240", blocks=BLOCKS)
    grabber = ScreenGrabber(CaptureSettings(region="560,240,400,300"))
    expected = expected_blocks()
    image = grab_until(grabber, lambda im: im.tobytes() == expected.tobytes())
    assert image.size == (400, 300)
    assert image.tobytes() == expected.tobytes()

    # The default region (800x600 centred on the primary monitor) starts at the same corner.
    default = ScreenGrabber(CaptureSettings())
    frame = default.grab()
    assert frame.rect == Rect(560, 240, 800, 600)
    assert frame.image.crop((0, 0, 400, 300)).tobytes() == expected.tobytes()

    # The PNG the worker gets decodes to the same pixels.
    png = grab_png(Settings(capture=CaptureSettings(region="560,240,400,300")))
    assert Image.open(io.BytesIO(png)).convert("RGB").tobytes() == expected.tobytes()
    grabber.close_thread()
    default.close_thread()


def test_each_thread_grabs_with_its_own_mss_instance(xdisplay, open_window):
    open_window("blocks", "400x300+560+240", blocks=BLOCKS)
    grabber = ScreenGrabber(CaptureSettings(region="560,240,400,300"))
    expected = grab_until(grabber, lambda im: im.tobytes() == expected_blocks().tobytes()).tobytes()
    results: list[bytes] = []

    def grab_in_thread():
        for _ in range(5):
            results.append(grabber.grab().image.tobytes())
        grabber.close_thread()

    threads = [threading.Thread(target=grab_in_thread) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(results) == 15 and all(r == expected for r in results)
    grabber.close_thread()


def test_watching_one_window_on_x11_says_it_needs_a_wayland_desktops_dialog(xdisplay):
    """capture.source = "window" is a Wayland desktop's sharing dialog: on X11 a clear error, never the whole screen."""
    with pytest.raises(CaptureError, match=r'X11 session: set capture.source = "monitor"'):
        ScreenGrabber(CaptureSettings(source="window")).grab()


def test_region_is_clipped_to_the_monitor_or_rejected_with_a_clear_error(xdisplay):
    monitor = Rect(0, 0, 1920, 1080)
    assert resolve_region(monitor, (1800, 1000, 400, 300)) == Rect(1800, 1000, 120, 80)
    assert resolve_region(Rect(1920, 0, 1280, 1024), (10, 20, 100, 100)) == Rect(1930, 20, 100, 100)
    with pytest.raises(CaptureError, match=r"starts outside the monitor, which is 1920x1080"):
        resolve_region(monitor, (2000, 10, 100, 100))
    frame = ScreenGrabber(CaptureSettings(region="1800,1000,400,300")).grab()
    assert frame.image.size == (120, 80)
    with pytest.raises(CaptureError, match=r"capture.monitor is 5.*monitors 0, 1"):
        ScreenGrabber(CaptureSettings(monitor=5)).grab()
    with pytest.raises(SettingsError, match=r"--region must be X,Y,W,H"):
        ScreenGrabber(CaptureSettings(), region="10,10,abc")


def test_a_changed_line_of_text_is_a_change_and_an_unchanged_screen_is_not(xdisplay, open_window):
    lines = [f"Line {i}: the quick brown fox jumps over the lazy dog" for i in range(8)]
    window = open_window("text", "800x600+560+240", lines=lines)
    grabber = ScreenGrabber(CaptureSettings())
    detector = ChangeDetector(threshold=CaptureSettings().change_threshold)
    first = grab_until(grabber, lambda im: im.getpixel((400, 300)) == (255, 255, 255))
    assert detector.is_changed(first)                 # nothing described yet
    detector.mark_described(first)
    assert not detector.is_changed(grabber.grab().image)

    window.set_line(5, "Line 5: the quick brown fox jumps over the lazy cat")
    changed = grabber.grab().image
    assert changed.tobytes() != first.tobytes()
    assert detector.is_changed(changed)
    assert detector.is_changed(grabber.grab().image)   # still compared with the last DESCRIBED frame
    detector.mark_described(changed)
    assert not detector.is_changed(grabber.grab().image)
    grabber.close_thread()


def test_the_active_window_title_is_read_and_matched_case_insensitively(xdisplay, open_window):
    open_window("Notes - editor", "300x200+50+50", lines=["notes"])
    vault = open_window("KeePassXC - Passwords.kdbx", "300x200+400+50", lines=["secret"])
    vault.focus()
    assert active_window_title() == "KeePassXC - Passwords.kdbx"
    verdict = check_privacy(Settings().excluded_titles)
    assert verdict.is_excluded and verdict.matched == "KeePass"
    assert "KeePassXC - Passwords.kdbx" in verdict.reason

    assert matching_exclusion("Mozilla Firefox (PRIVATE BROWSING)", ["private browsing"]) == "private browsing"
    assert matching_exclusion("Notes - editor", Settings().excluded_titles) == ""
    assert matching_exclusion(None, ["x"]) == ""


@pytest.mark.parametrize("environ, kind", [
    ({"XDG_SESSION_TYPE": "x11", "DISPLAY": ":0"}, SessionType.X11),
    ({"XDG_SESSION_TYPE": "wayland", "DISPLAY": ":1", "WAYLAND_DISPLAY": "wayland-0"}, SessionType.WAYLAND),
    ({"XDG_SESSION_TYPE": "wayland", "DISPLAY": ":1"}, SessionType.WAYLAND),          # the login manager said so
    ({"DISPLAY": ":1", "WAYLAND_DISPLAY": "wayland-0"}, SessionType.WAYLAND),         # a terminal in the session
    ({"XDG_SESSION_TYPE": "tty", "DISPLAY": "localhost:10.0"}, SessionType.X11),      # ssh -X
    ({"XDG_SESSION_TYPE": "x11", "DISPLAY": ":0", "WAYLAND_DISPLAY": "wayland-1"}, SessionType.X11),  # nested
    ({"XDG_SESSION_TYPE": "tty"}, SessionType.NONE),
])
def test_the_session_decides_the_capture_backend(environ, kind):
    session = Session.detect(environ, platform="linux")
    assert session.kind == kind
    if kind == SessionType.X11:
        session.check_can_capture()
        return
    with pytest.raises(CaptureError) as refused:
        session.check_can_capture()
    if kind == SessionType.NONE:
        assert "DISPLAY is not set" in str(refused.value) and "--image FILE" in str(refused.value)
    else:
        assert str(refused.value).startswith("This is a Wayland session (WAYLAND_DISPLAY=")
        assert "X11 capture through Xwayland is black on Wayland" in str(refused.value)
        assert 'choose "GNOME on Xorg" or "Plasma (X11)"' in str(refused.value)
    assert Session.detect(environ, platform="darwin").kind == SessionType.NATIVE


def test_a_black_window_over_the_region_is_refused_but_the_black_desktop_background_is_not(xdisplay, open_window):
    """Xvfb's root is black: with nothing in the region that is the screen, and it is grabbed. A black window there
    (a video player, a window that draws nothing) is refused with the cause and the fix, never described."""
    empty = ScreenGrabber(CaptureSettings(region="1500,700,300,200"))
    frame = empty.grab()
    assert is_black(frame.image) and frame.windows == ()

    open_window("Video - player", "400x300+1450+650", blocks=[(0, 0, 400, 300, "#000000")])
    with pytest.raises(CaptureError) as refused:
        empty.grab()
    message = str(refused.value)
    assert message.startswith("The screen grab of 300x200 at 1500,700 is uniformly black, so DeskEye does not "
                              "describe it. If a black window covers that region, move it")
    assert 'choose "GNOME on Xorg" or "Plasma (X11)"' in message
    empty.close_thread()
