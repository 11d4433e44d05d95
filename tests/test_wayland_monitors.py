"""DeskEye's region and masks on a Wayland desktop whose monitor is not at 0,0, or not at scale 1.

DeskEye's windows are Xwayland windows, placed in Xwayland's pixels (the compositor's layout: logical pixels),
while the portal's frames are the compositor's own (deskeye/see/capture.py). Headless sway (tests/fixtures/sway.py)
with a second output made by `swaymsg create_output` and its portal's Screenshot, as measured on sway 1.7:

  layout (outputs, positions, scales)          | Xwayland's monitors (mss)       | the portal's screenshot
  1280x800 at 0,0 + 1024x768 at 1280,0          | 1280x800+0+0, 1024x768+1280+0   | 2304x800 (the whole layout)
  1024x768 at 0,0 + 1280x800 at 1024,0          | 1280x800+1024+0, 1024x768+0+0   | 2304x800
  1280x800 at scale 2                           | 640x400+0+0                     | 1280x800 (physical pixels)
  1280x800 + 1024x768 at 1280,0 at scale 2      | 1280x800+0+0, 512x384+1280+0    | 3584x1600 (all at scale 2)

In each, the real overlay (deskeye.ui.overlay, a Tk window through Xwayland, opaque, showing an answer) is placed on
the watched monitor as `deskeye run` places it (on `ScreenGrabber.monitor()`), and the whole monitor is grabbed
through the real portal with DeskEye's masking (its own windows read from X11), in a subprocess inside the desktop.
The frame is checked against the compositor's own pixels (`grim`, which the portal runs too): it is exactly that
monitor, at the compositor's resolution, except where it is masked; the overlay is on that monitor and the mask
covers all of it (not one pixel of the overlay's colour is left in the frame).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

import pytest

from deskeye.see.capture import MASK_COLOUR
from tests.fixtures.deskeye_process import REPO_ROOT
from tests.fixtures.sway import sway_desktop  # noqa: F401 - a fixture
from tests.test_wayland_own_windows import ANSWER_COLOUR, app_env, masked_box, on_a_desktop, wait_for_overlay

SECOND_BG = "#669933"          # HEADLESS-2's background (HEADLESS-1's is the fixture's #336699)

# In the desktop: the overlay on the watched monitor, as the app places it; one grab when the test says.
GRAB_SCRIPT = r"""
import json, sys
from deskeye.see.capture import ScreenGrabber
from deskeye.see.x11_windows import OwnWindows
from deskeye.settings import CaptureSettings, OverlaySettings
from deskeye.ui.menu import MenuActions
from deskeye.ui.overlay import Kind, Overlay, OverlayContent
monitor, region, position, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
overlay_settings = OverlaySettings(fade_after_s=0.0, alpha=1.0, position=position)
own = OwnWindows()
grabber = ScreenGrabber(CaptureSettings(monitor=monitor, region=region), overlay=overlay_settings, mask=own.own_rects)
area = grabber.monitor()                   # where `deskeye run` puts the overlay (App._overlay_area)
overlay = Overlay(overlay_settings, area, own_windows=own, menu_actions=MenuActions())
overlay.start()
try:
    overlay.show(OverlayContent(Kind.ANSWER, "A spreadsheet of the quarterly costs", ("spreadsheet",)))
    assert overlay.wait_for(lambda shown: shown is not None, 10)
    print("shown", flush=True)
    sys.stdin.readline()                   # the test has seen the overlay on the compositor's screen
    frame = grabber.grab(with_windows=False)
    frame.image.save(out)
    print(json.dumps({"area": list(vars(area).values()), "rect": list(vars(frame.rect).values()),
                      "masked": [list(vars(m).values()) for m in frame.masked]}), flush=True)
finally:
    overlay.stop()
    grabber.close_thread()
    own.close_thread()
"""


@dataclass(frozen=True)
class Layout:
    name: str
    commands: tuple[str, ...]          # swaymsg commands that make it
    monitor: int                       # capture.monitor (mss numbering)
    region: str                        # the whole monitor, relative to it, in the desktop's pixels
    on_screen: tuple[int, int, int, int]   # that monitor in the compositor's screenshot (left, top, right, bottom)
    background: str                    # its background colour
    position: str = "bottom-right"     # overlay.position


LAYOUTS = [
    Layout("monitor 2 right of monitor 1",
           ("create_output", f"output HEADLESS-2 pos 1280 0 res 1024x768 bg {SECOND_BG} solid_color"),
           2, "0,0,1024,768", (1280, 0, 2304, 768), SECOND_BG),
    Layout("monitor 1 right of monitor 2",
           ("create_output", f"output HEADLESS-2 pos 0 0 res 1024x768 bg {SECOND_BG} solid_color",
            "output HEADLESS-1 pos 1024 0"),
           1, "0,0,1280,800", (1024, 0, 2304, 800), "#336699"),
    # Top-left: at 0,0 the overlay lands on the monitor even where DeskEye takes the frame's pixels for Xwayland's.
    Layout("one monitor at scale 2", ("output HEADLESS-1 scale 2",), 1, "0,0,640,400", (0, 0, 1280, 800),
           "#336699", "top-left"),
    Layout("monitor 2 at scale 2 right of monitor 1 at scale 1",
           ("create_output", f"output HEADLESS-2 pos 1280 0 res 1024x768 scale 2 bg {SECOND_BG} solid_color"),
           2, "0,0,512,384", (2560, 0, 3584, 768), SECOND_BG),
]


@on_a_desktop
@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout.name for layout in LAYOUTS])
def test_the_frame_is_the_watched_monitor_and_the_overlay_is_masked_in_its_pixels(sway_desktop, tmp_path,  # noqa: F811
                                                                                  layout):
    import numpy as np
    from PIL import Image

    for command in layout.commands:
        done = subprocess.run(["swaymsg", "-s", sway_desktop.socket, command], capture_output=True, text=True,
                              timeout=10)
        assert done.returncode == 0, done.stdout + done.stderr
    sway_desktop.start_portal(private_tmp=True)        # its Screenshot's /tmp/out.png is this test's alone
    home = sway_desktop.shared_folder("app")
    env = sway_desktop.env(**app_env(home, "XDG_RUNTIME_DIR"))
    shot, out = tmp_path / "screen.png", home / "frame.png"

    def screenshot():
        done = subprocess.run(["grim", str(shot)], capture_output=True, text=True, timeout=30, env=env)
        assert done.returncode == 0, done.stderr
        with Image.open(shot) as image:
            return image.convert("RGB")
    proc = subprocess.Popen(sway_desktop.command([sys.executable, "-c", GRAB_SCRIPT, str(layout.monitor),
                                                  layout.region, layout.position, str(out)]),
                            cwd=REPO_ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        said = proc.stdout.readline()
        assert said.strip() == "shown", said + proc.stderr.read()
        screen, box = wait_for_overlay(screenshot, 20)
        proc.stdin.write("grab\n")
        proc.stdin.flush()
        grabbed = proc.stdout.readline()
        assert proc.wait(30) == 0 and grabbed, grabbed + proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
    facts = json.loads(grabbed)
    with Image.open(out) as image:
        frame = image.convert("RGB")
    screen.save(tmp_path / "compositor.png")          # for a failure's reader
    frame.save(tmp_path / "sent.png")
    left, top, right, bottom = layout.on_screen
    assert left <= box[0] and top <= box[1] and box[2] <= right and box[3] <= bottom, \
        f"the overlay {box} is not on the watched monitor {layout.on_screen}: DeskEye placed it at {facts}"
    pixels = np.asarray(frame)
    left_over = int((pixels == np.array(ANSWER_COLOUR, dtype=pixels.dtype)).all(axis=2).sum())
    assert left_over == 0, f"{left_over} pixels of the overlay are in the frame: the mask missed it ({facts})"
    assert frame.size == (right - left, bottom - top), f"the frame is not the whole monitor: {frame.size}, {facts}"
    expected = np.asarray(screen.crop(layout.on_screen))
    masked = (pixels == np.array(MASK_COLOUR, dtype=pixels.dtype)).all(axis=2)
    differs = (pixels != expected).any(axis=2) & ~masked
    assert not differs.any(), f"the frame is not the watched monitor's pixels ({differs.sum()} differ): {facts}"
    background = tuple(int(layout.background[i:i + 2], 16) for i in (1, 3, 5))
    assert (pixels == np.array(background, dtype=pixels.dtype)).all(axis=2).mean() > 0.5, "another monitor's pixels"
    in_frame = (box[0] - left, box[1] - top, box[2] - left, box[3] - top)
    covered = masked_box(frame, in_frame)
    assert covered is not None and covered[0] <= in_frame[0] and covered[1] <= in_frame[1] \
        and in_frame[2] <= covered[2] and in_frame[3] <= covered[3], (covered, in_frame, facts)


# ------------------------------------------------------------------ where the mapping cannot be known

def test_a_screenshot_that_is_not_the_layout_at_one_scale_is_refused_naming_both():
    """Xwayland's monitors that do not fit the portal's screenshot at any one scale (an output Xwayland does not
    see, a compositor that scales Xwayland its own way): the region and the masks cannot be placed, so no frame."""
    from deskeye.errors import CaptureError
    from deskeye.see.geometry import FrameMap, Rect
    from deskeye.see.portal_screenshot import screenshot_map
    layout = [Rect(0, 0, 2304, 800), Rect(0, 0, 1280, 800), Rect(1280, 0, 1024, 768)]
    assert screenshot_map((4608, 1600), layout) == ([Rect(0, 0, 2304, 800), *layout[1:]], FrameMap(0, 0, 2.0, 2.0))
    with pytest.raises(CaptureError, match=r"screenshot is 2304x1600, .* \(1280x800\+0\+0, 1024x768\+1280\+0\)"):
        screenshot_map((2304, 1600), layout)
    assert screenshot_map((1280, 800), []) == ([Rect(0, 0, 1280, 800)] * 2, FrameMap())    # no X: as it is


def test_a_streamed_monitor_xwayland_does_not_report_is_said_and_mapped_where_the_portal_says():
    from deskeye.see.geometry import FrameMap, Rect
    from deskeye.see.portal_screencast import stream_map
    xwayland = [Rect(0, 0, 2304, 800), Rect(0, 0, 1280, 800), Rect(1280, 0, 1024, 768)]
    monitor, frame_map, unknown = stream_map((2048, 1536), (1280, 0), (1024, 768), xwayland)
    assert (monitor, frame_map, unknown) == (Rect(1280, 0, 1024, 768), FrameMap(1280, 0, 2.0, 2.0), "")
    assert frame_map.box(Rect(1300, 10, 5, 5)) == (40, 20, 50, 30)
    monitor, frame_map, unknown = stream_map((1024, 768), None, None, xwayland)      # the portal did not say
    assert monitor == Rect(0, 0, 1024, 768) and "does not say where it lies" in unknown
    assert "DeskEye cannot tell where its own windows" in unknown and "1024x768+1280+0" in unknown


def test_a_fractional_scale_masks_every_frame_pixel_a_window_touches():
    from deskeye.see.geometry import FrameMap, Rect
    assert FrameMap(0, 0, 1.25, 1.25).box(Rect(4, 4, 4, 4)) == (5, 5, 10, 10)
    assert FrameMap(0, 0, 1.5, 1.5).box(Rect(1, 1, 1, 1)) == (1, 1, 3, 3)
