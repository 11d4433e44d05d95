"""Default settings on a quiet desktop: after the first description nothing more is sent for a minute and the
overlay fades (1600x900 and 1366x768, where the old default region lay under the overlay); with a ticking
xclock in the region, at most one describe a minute comes from the clock. The three desktops run side by side
(real `deskeye run` processes, each with its OCR worker), so the minute is spent once.
"""

from __future__ import annotations

import subprocess
import time

import pytest

from deskeye.see.geometry import Rect
from deskeye.see.placement import default_region, overlay_column
from tests.fixtures.deskeye_process import start_deskeye
from tests.fixtures.desktop import start_desktop
from tests.fixtures.processes import stop_process
from tests.fixtures.tk_windows import open_test_window

pytestmark = [pytest.mark.desktop, pytest.mark.subprocess]

QUIET_MINUTE_S = 62.0
LINES = ["Traceback (most recent call last):", '  File "report.py", line 12, in <module>',
         "ZeroDivisionError: division by zero"]
CASES = {"static-1600x900": (1600, 900, False), "static-1366x768": (1366, 768, False),
         "xclock-1600x900": (1600, 900, True)}


def settled_count(app, quiet_s: float = 3.0, timeout_s: float = 120.0) -> int:
    """The worker's request count once it has not moved for `quiet_s`."""
    deadline = time.monotonic() + timeout_s
    count, since = app.chat_requests(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = app.chat_requests()
        if now != count:
            count, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s and count >= 1:
            return count
    raise AssertionError("the app never went quiet")


@pytest.fixture
def quiet_desktops():
    running = {}
    try:
        for name, (width, height, with_clock) in CASES.items():
            desktop = start_desktop(width, height, tray="trayer")
            monitor = Rect(0, 0, width, height)
            region = default_region(monitor, overlay_column(monitor, 420, 16, "bottom-right"))
            window = open_test_window(desktop.display, "xterm - python report.py",
                                      f"{region.width}x{region.height}+{region.left}+{region.top}", lines=LINES)
            clock = None
            if with_clock:
                clock = subprocess.Popen(["xclock", "-update", "1", "-geometry",
                                          f"+{region.left + 500}+{region.top + 300}"], env=desktop.env())
            running[name] = (desktop, window, clock, start_deskeye(desktop, settings=""))
        yield {name: parts[3] for name, parts in running.items()}
    finally:
        for desktop, window, clock, app in running.values():
            app.stop()
            if clock is not None:
                stop_process(clock)
            window.close()
            desktop.stop()


@pytest.mark.slow
def test_a_quiet_screen_is_described_once_and_a_clock_at_most_once_a_minute(quiet_desktops):
    for name, app in quiet_desktops.items():
        assert app.read_until("deskeye: watching", 90), f"{name}: {''.join(app.output)}"
    first = {name: settled_count(app) for name, app in quiet_desktops.items()}
    time.sleep(QUIET_MINUTE_S)
    later = {name: app.chat_requests() for name, app in quiet_desktops.items()}
    for name in ("static-1600x900", "static-1366x768"):
        assert later[name] == first[name], f"{name}: {later[name] - first[name]} describes of a static screen"
        assert quiet_desktops[name].overlay_rect() is None, f"{name}: the overlay never faded"
    assert later["xclock-1600x900"] - first["xclock-1600x900"] <= 1
