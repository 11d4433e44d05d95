"""Sizes from the screen: on real Xvfb desktops at 96, 144 and 192 dpi, with one monitor and with two (set with
`xrandr --setmonitor` on one 3200x1080 X screen) and a panel docked on the second, DeskEye lays out in logical pixels:
the default region is 800x600 as a person sees it (1600x1200 physical at 192 dpi), the overlay and the Ask box are
whole on the monitor DeskEye watches and never under the panel (nor moved by a panel on the other monitor), and
`deskeye run`, `deskeye describe` and `deskeye doctor` all watch the same region.

Everything goes through the real programs: DeskEye as a user starts it (`deskeye run`, hotkeys pressed with xdotool),
the one-shot commands and doctor as subprocesses, one real OCR worker they all use (worker.url), and the geometry
read back from the X server. The DPI comes from where desktops put it: Xft.dpi (xrdb), else the RandR monitors'
physical sizes; Xvfb's -dpi (the X screen's own DPI) where Tk would also pick it up by itself.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.deskeye_process import start_deskeye
from tests.fixtures.polling import wait_until
from tests.fixtures.screens import Box, MonitorSpec, ScreenSpec, start_screen_desktop
from tests.fixtures.worker import running_worker

pytestmark = [pytest.mark.desktop, pytest.mark.subprocess]

REPO_ROOT = Path(__file__).resolve().parents[1]
OVERLAY_TITLE, ASK_TITLE = "DeskEye overlay", "Ask DeskEye"
REGION_SIZE, OVERLAY_WIDTH, MARGIN = (800, 600), 420, 16          # DeskEye's defaults, in logical pixels
DOCK_PX = 72
TWO_MONITORS = (3200, 1080)


def two_monitors(dpi: float) -> tuple[MonitorSpec, ...]:
    return MonitorSpec((0, 0, 1920, 1080), dpi), MonitorSpec((1920, 0, 1280, 1024), dpi)


# name: (the desktop, the monitor DeskEye watches, the scale DeskEye must find)
CASES = {
    "one-monitor-144dpi-xft": (ScreenSpec((2880, 1620), xft_dpi=144), 1, 1.5),
    "one-monitor-192dpi-xft-and-xvfb": (ScreenSpec((3840, 2160), xft_dpi=192, xvfb_dpi=192), 1, 2.0),
    "two-monitors-96dpi-watching-1": (ScreenSpec(TWO_MONITORS, two_monitors(96), dock=(1, DOCK_PX)), 1, 1.0),
    "two-monitors-144dpi-xft-watching-2": (ScreenSpec(TWO_MONITORS, two_monitors(96), xft_dpi=144,
                                                      dock=(1, DOCK_PX)), 2, 1.5),
    "two-monitors-192dpi-randr-watching-2": (ScreenSpec(TWO_MONITORS, two_monitors(192), dock=(1, DOCK_PX)), 2, 2.0),
}


@pytest.fixture(scope="module")
def ocr_worker(tmp_path_factory):
    """One real OCR worker that the app, `describe` and `doctor` of every case use (worker.url)."""
    with running_worker(["--engine", "ocr"], tmp_path_factory.mktemp("ocr_worker")) as handle:
        yield handle


def chat_requests(worker) -> int:
    return int(sum(value for name, value in worker.metrics().items()
                   if name.startswith("deskeye_worker_requests_total") and "chat/completions" in name))


def region_in(text: str, words: str) -> Box | None:
    """The region a line of DeskEye's output names ("<words> WxH at X,Y"), as (left, top, width, height)."""
    match = re.search(rf"{words} (\d+)x(\d+) at (-?\d+),(-?\d+)", text)
    if match is None:
        return None
    width, height, left, top = (int(g) for g in match.groups())
    return left, top, width, height


def deskeye(desktop, settings: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deskeye.cli", "--settings", str(settings), *args],
                          env=desktop.env(PYTHONPATH=str(REPO_ROOT)), cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=180)


def inside(inner: Box, outer: Box) -> bool:
    return (outer[0] <= inner[0] and outer[1] <= inner[1]
            and inner[0] + inner[2] <= outer[0] + outer[2] and inner[1] + inner[3] <= outer[1] + outer[3])


def overlaps(a: Box, b: Box) -> bool:
    return a[0] < b[0] + b[2] and b[0] < a[0] + a[2] and a[1] < b[1] + b[3] and b[1] < a[1] + a[3]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_sizes_follow_the_monitor_and_every_command_watches_the_same_region(case, ocr_worker):
    spec, number, scale = CASES[case]
    desktop = start_screen_desktop(spec)
    app = None
    try:
        text = (f'[capture]\nmonitor = {number}\n[worker]\nurl = "{ocr_worker.url}"\napi_key = "{ocr_worker.api_key}"\n'
                '[overlay]\nfade_after_s = 0.0\n[hooks]\ndry_run = true\n')
        settings = desktop.home / "one-shot.toml"
        settings.write_text(text, encoding="utf-8")
        doctor = deskeye(desktop, settings, "doctor")
        described = deskeye(desktop, settings, "describe", "--json")
        assert described.returncode == 0, described.stderr

        before = chat_requests(ocr_worker)
        app = start_deskeye(desktop, settings=text)
        watching = region_in(app.read_until("deskeye: watching", 120), "watching")
        assert watching is not None, "".join(app.output)
        assert wait_until(lambda: chat_requests(ocr_worker) > before, 120), "the app never described its region"
        overlay = desktop.settled_frame(OVERLAY_TITLE)
        assert overlay is not None, "the overlay never showed the description"
        desktop.run("xdotool", "key", "ctrl+alt+a")
        ask_box = desktop.settled_frame(ASK_TITLE)
        assert ask_box is not None, "the Ask box never opened"
    finally:
        if app is not None:
            app.stop()
        desktop.stop()

    def px(logical: int) -> int:
        return round(logical * scale)
    monitor, work_area = spec.monitor(number), spec.work_area(number)

    # The default region: 800x600 logical pixels where it fits beside the overlay, on the watched monitor.
    assert inside(watching, work_area), (watching, work_area)
    assert watching[3] == min(px(REGION_SIZE[1]), work_area[3]), watching
    beside_overlay = overlay[0] - px(MARGIN) - work_area[0]
    assert watching[2] == min(px(REGION_SIZE[0]), beside_overlay), (watching, overlay)
    if case.startswith("one-monitor"):
        assert watching[2:] == (px(REGION_SIZE[0]), px(REGION_SIZE[1]))        # 1600x1200 at 192 dpi

    # The overlay: its logical width, in the bottom-right corner of the watched monitor's own work area.
    assert overlay[2] == px(OVERLAY_WIDTH), overlay
    assert overlay[0] + overlay[2] == work_area[0] + work_area[2] - px(MARGIN), (overlay, work_area)
    assert overlay[1] + overlay[3] == work_area[1] + work_area[3] - px(MARGIN), (overlay, work_area)

    # The Ask box (with the window manager's frame): whole on the monitor, off the panel, over neither.
    assert inside(ask_box, work_area), (ask_box, work_area)
    assert not overlaps(ask_box, overlay) and not overlaps(ask_box, watching), (ask_box, overlay, watching)
    assert ask_box[2] >= px(OVERLAY_WIDTH), ask_box

    # One region for all: the app, `deskeye describe` and `deskeye doctor`.
    assert region_in(described.stderr, "looking at") == watching, described.stderr
    assert region_in(doctor.stdout, "grabbed") == watching, doctor.stdout
    assert inside(watching, monitor)
