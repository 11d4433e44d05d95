"""What `deskeye run` costs on a quiet desktop: CPU of the app and its worker on a static screen, and
describes per minute with a ticking xclock in the watched region. Side by side in one run, each on its own
test desktop (Xvfb 1600x900, openbox, xcompmgr, dunst, trayer), default settings (OCR worker).

    .venv/bin/python -m benchmarks.app_idle [--minutes 1] [--json-out PATH]

CPU is psutil's user+system time of the app process and all its children over the window (after the first
description has settled), as a percentage of one core. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path

from benchmarks._harness import process_tree_cpu_s
from benchmarks._results import write_result
from deskeye.geometry import Rect
from deskeye.placement import default_region, overlay_column
from tests.fixtures.deskeye_process import start_deskeye
from tests.fixtures.desktop import start_desktop
from tests.fixtures.processes import stop_process
from tests.fixtures.tk_windows import open_test_window

DEFAULT_JSON_OUT = Path("benchmarks/results/app_idle.json")
LINES = ["Traceback (most recent call last):", '  File "report.py", line 12, in <module>',
         "ZeroDivisionError: division by zero"]


def settle(app, quiet_s: float = 3.0) -> int:
    count, since = app.chat_requests(), time.monotonic()
    while time.monotonic() - since < quiet_s or count < 1:
        time.sleep(0.5)
        now = app.chat_requests()
        if now != count:
            count, since = now, time.monotonic()
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=1.0)
    parser.add_argument("--json-out", type=Path, default=DEFAULT_JSON_OUT)
    args = parser.parse_args()
    window_s = args.minutes * 60
    cases, running = {"static screen": False, "xclock in the region": True}, []
    try:
        for name, with_clock in cases.items():
            desktop = start_desktop(1600, 900)
            monitor = Rect(0, 0, 1600, 900)
            region = default_region(monitor, overlay_column(monitor, 420, 16, "bottom-right"))
            window = open_test_window(desktop.display, "xterm", f"{region.width}x{region.height}+{region.left}"
                                      f"+{region.top}", lines=LINES)
            clock = subprocess.Popen(["xclock", "-update", "1", "-geometry", f"+{region.left + 500}+{region.top + 300}"],
                                     env=desktop.env()) if with_clock else None
            app = start_deskeye(desktop)
            running.append((name, desktop, window, clock, app))
        for _, _, _, _, app in running:
            assert app.read_until("deskeye: watching", 90), "".join(app.output)
        start = {name: (settle(app), process_tree_cpu_s(app.proc.pid)) for name, _, _, _, app in running}
        time.sleep(window_s)
        rows = []
        for name, _, _, _, app in running:
            count, cpu = app.chat_requests(), process_tree_cpu_s(app.proc.pid)
            rows.append({"case": name, "window_s": window_s,
                         "cpu_percent_of_one_core": round(100 * (cpu - start[name][1]) / window_s, 2),
                         "describes_per_minute": round((count - start[name][0]) * 60 / window_s, 2)})
    finally:
        for _, desktop, window, clock, app in running:
            app.stop()
            if clock is not None:
                stop_process(clock)
            window.close()
            desktop.stop()
    print(f"{'case':<22} {'window s':>8} {'CPU % (app+worker)':>19} {'describes/min':>14}")
    for row in rows:
        print(f"{row['case']:<22} {row['window_s']:>8.0f} {row['cpu_percent_of_one_core']:>19.2f} "
              f"{row['describes_per_minute']:>14.2f}")
    write_result(args.json_out, {"rows": rows})


if __name__ == "__main__":
    main()
