"""What `deskeye run` costs on a quiet desktop: CPU of the app and its worker on a static screen, and
describes per minute with a ticking xclock in the watched region. Side by side in one run, each on its own
test desktop, the real `deskeye run --engine ocr` with default settings (the OCR worker; only its start-up and
request timeouts raised for a busy machine).

    .venv/bin/python -m benchmarks.app_idle [--desktop x11|gnome|kwin|sway] [--minutes 1] [--case static|clock|both]
                                            [--json-out PATH]

Desktops (`--desktop`, default x11):
- x11: Xvfb 1600x900 with openbox, xcompmgr, dunst and trayer; an xterm in the region (the cases: static, clock).
- gnome: headless gnome-shell 43 with PipeWire and the GNOME portal (tests/fixtures/gnome.py), a native GTK window
  with the same lines full screen; DeskEye runs inside the session's namespaces and sees it through the portal's
  ScreenCast, the user's consent played with a seeded restore token. Static screen only.
- kwin: headless kwin_wayland 5.27 with the KDE portal (tests/fixtures/kde.py), a native GTK window full screen;
  DeskEye sees it through the portal's Screenshot (`capture.portal = "screenshot"`: KDE's ScreenCast would show its
  chooser, which nobody answers here), one screenshot per capture tick, and reads KWin's window list (a KWin script)
  for privacy at each one. Static screen only.
- sway: headless sway 1.7 with the wlr portal (tests/fixtures/sway.py), a native GTK window; DeskEye sees it through
  the portal's Screenshot (the wlr ScreenCast needs a GPU), one screenshot per capture tick. Static screen only. The
  wlr portal writes the fixed file /tmp/out.png: run one sway benchmark at a time.

CPU is psutil's user+system time of the app process and all its children over the window (after the first
description has settled), as a percentage of one core, and of the app and its worker apart; beside it the desktop's
own processes (compositor, X server, portal, PipeWire) over the same window: what DeskEye's watching makes the
desktop do. Prints a table and writes JSON, with the machine's load average over the window. On a busy machine the
figures are upper bounds: compare runs taken under the same load (one case at a time adds less load of its own).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil

from benchmarks._harness import process_tree_cpu_s
from benchmarks._results import write_result
from deskeye.see.geometry import Rect
from deskeye.see.placement import default_region, overlay_column
from tests.fixtures.deskeye_process import REPO_ROOT, DeskEyeProcess, start_deskeye
from tests.fixtures.polling import wait_until
from tests.fixtures.processes import stop_process

DEFAULT_JSON_OUT = Path("benchmarks/results/app_idle.json")
CASES = {"static": ("static screen", False), "clock": ("xclock in the region", True)}
DESKTOPS = ("x11", "gnome", "kwin", "sway")
LINES = ["Traceback (most recent call last):", '  File "report.py", line 12, in <module>',
         "ZeroDivisionError: division by zero"]
TOKEN_FILE = "deskeye/screencast-restore-token"        # where DeskEye keeps the portal's restore token
WORKER_SETTINGS = "[worker]\nstartup_timeout_s = 120.0\nrequest_timeout_s = 120.0\n"    # a busy machine
READY_TIMEOUT_S = 120.0


@dataclass
class Running:
    """One case being measured: the app, where its process is, the desktop's processes, and how to end it all."""
    case: str
    app: DeskEyeProcess
    app_pid: int                                   # the app itself (its parent may be nsenter)
    desktop_pids: Callable[[], list[int]]          # the roots of the desktop's process trees
    backend: str = ""
    stops: list[Callable[[], None]] = field(default_factory=list)      # run in reverse order

    def stop(self) -> None:
        for stop in reversed(self.stops):
            try:
                stop()
            except Exception as exc:  # noqa: BLE001 - the rest must still stop
                print(f"stopping {self.case}: {exc}")


def settle(app, quiet_s: float = 3.0, timeout_s: float = READY_TIMEOUT_S) -> int:
    """The worker's request count once the first description came and none followed for `quiet_s`."""
    count, since = app.chat_requests(), time.monotonic()
    deadline = since + timeout_s
    while time.monotonic() - since < quiet_s or count < 1:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no description settled within {timeout_s:.0f} s:\n{''.join(app.output)[-3000:]}")
        time.sleep(0.5)
        now = app.chat_requests()
        if now != count:
            count, since = now, time.monotonic()
    return count


def cpu_s(process) -> float:
    """User + system CPU seconds of one process so far (0 when it is gone)."""
    if process is None:
        return 0.0
    try:
        times = process.cpu_times()
    except psutil.NoSuchProcess:
        return 0.0
    return times.user + times.system


def tree_cpu_s(pid: int) -> float:
    try:
        return process_tree_cpu_s(pid)
    except psutil.NoSuchProcess:
        return 0.0


def desktop_processes(running: Running) -> list[psutil.Process]:
    """The desktop's processes: each root's tree, and its process group (where dbus-daemon starts the portals and
    sway starts swaybg, they leave the tree: their parent is then init, their group still the root's)."""
    roots = set(running.desktop_pids())
    found: dict[int, psutil.Process] = {}
    for pid in roots:
        try:
            root = psutil.Process(pid)
            found.update((p.pid, p) for p in [root, *root.children(recursive=True)])
        except psutil.NoSuchProcess:
            continue
    for process in psutil.process_iter():
        try:
            if process.pid not in found and os.getpgid(process.pid) in roots:
                found[process.pid] = process
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return list(found.values())


def desktop_cpu_s(running: Running) -> float:
    """CPU seconds of the desktop's processes, with their children that have ended (the wlr portal runs `grim` for
    every screenshot): each living process's own time plus its reaped children's."""
    total = 0.0
    for process in desktop_processes(running):
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


def desktop_programs(running: Running) -> list[str]:
    """The names of the desktop's programs whose CPU is counted (sorted): the compositor should be among them."""
    names = set()
    for process in desktop_processes(running):
        try:
            names.add(process.name())
        except psutil.NoSuchProcess:
            continue
    return sorted(names)


def cpu_now(running: Running) -> dict[str, float]:
    """CPU seconds so far: the app's whole process tree, the app alone, its worker alone, the desktop's processes."""
    app = running.app
    return {"tree": tree_cpu_s(app.proc.pid), "app": cpu_s(psutil.Process(running.app_pid)),
            "worker": cpu_s(app.worker()), "desktop": desktop_cpu_s(running)}


def keep_reading(app: DeskEyeProcess) -> None:
    """Read the app's output on a thread from now on (into `app.output`): a pipe nobody reads would fill and
    block the app."""
    def read() -> None:
        for line in app.proc.stdout:
            app.output.append(line)
    threading.Thread(target=read, name="app-output", daemon=True).start()


def profile(running: list[Running], window_s: float, out: Path | None) -> list[subprocess.Popen]:
    """py-spy sampling each app (not its worker) over the window, stacks written to `out` (one file per case)."""
    if out is None:
        return []
    spy = Path(sys.executable).with_name("py-spy")
    return [subprocess.Popen([str(spy), "record", "--pid", str(each.app_pid), "--duration", str(int(window_s)),
                              "--rate", "100", "--format", "raw", "--threads", "--output",
                              str(out.with_suffix(f".{index}.txt"))], stdout=subprocess.DEVNULL)
            for index, each in enumerate(running)]


def deskeye_home(folder: Path, token: str = "") -> dict[str, str]:
    """DeskEye's own XDG folders under `folder` (0700), the portal's restore token saved where DeskEye keeps it
    (0600) when given: the user's one-time consent."""
    dirs = {}
    for name in ("XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME"):
        (folder / name.lower()).mkdir(mode=0o700, parents=True, exist_ok=True)
        dirs[name] = str(folder / name.lower())
    if token:
        path = folder / "xdg_state_home" / TOKEN_FILE
        path.parent.mkdir(mode=0o700, exist_ok=True)
        path.write_text(token, encoding="ascii")
        path.chmod(0o600)
    return dirs


def start_x11(with_clock: bool, case: str) -> Running:
    from tests.fixtures.desktop import start_desktop
    from tests.fixtures.tk_windows import open_test_window

    desktop = start_desktop(1600, 900)
    stops: list[Callable[[], None]] = [desktop.stop]
    try:
        monitor = Rect(0, 0, 1600, 900)
        region = default_region(monitor, overlay_column(monitor, 420, 16, "bottom-right"))
        window = open_test_window(desktop.display, "xterm", f"{region.width}x{region.height}+{region.left}"
                                  f"+{region.top}", lines=LINES)
        stops.append(window.close)
        if with_clock:
            clock = subprocess.Popen(["xclock", "-update", "1", "-geometry",
                                      f"+{region.left + 500}+{region.top + 300}"], env=desktop.env())
            stops.append(lambda: stop_process(clock))
        app = start_deskeye(desktop, "--engine", "ocr", settings=WORKER_SETTINGS)
        stops.append(app.stop)
    except BaseException:
        for stop in reversed(stops):
            stop()
        raise
    return Running(case, app, app.proc.pid, lambda: [p.pid for p in desktop.procs.values()],
                   f"mss on Xvfb {desktop.display.name}", stops)


def start_gnome_case(folder: Path) -> Running:
    """gnome-shell headless, a native GTK window full screen, DeskEye inside the session with a seeded token."""
    from tests.fixtures.gnome import open_native_window, start_gnome, stop_inside

    desktop = start_gnome(folder / "gnome")
    stops: list[Callable[[], None]] = [desktop.stop]
    try:
        window = open_native_window(desktop, "Report", "\n".join(LINES))
        stops.append(lambda: stop_process(window, timeout_s=5))
        home = deskeye_home(folder / "deskeye", desktop.consent_to_screencast())
        settings = folder / "deskeye" / "settings.toml"
        settings.write_text(WORKER_SETTINGS, encoding="utf-8")
        env = desktop.env(PYTHONPATH=str(REPO_ROOT), HF_HUB_OFFLINE="1", NO_AT_BRIDGE="1", **home)
        proc = desktop.popen([sys.executable, "-m", "deskeye.cli", "--settings", str(settings), "run", "--engine",
                              "ocr"], cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        stops.append(lambda: stop_inside(proc, timeout_s=30))
        app = DeskEyeProcess(proc, desktop, [])
        child = wait_until(lambda: psutil.Process(proc.pid).children(), 30)      # nsenter's child: the app
        if not child:
            raise RuntimeError("deskeye run did not start inside the GNOME session")
    except BaseException:
        for stop in reversed(stops):
            stop()
        raise
    return Running("static screen", app, child[0].pid, lambda: [desktop.proc.pid],
                   "xdg-desktop-portal ScreenCast (GNOME)", stops)


def start_kwin_case(folder: Path) -> Running:
    """kwin_wayland headless with its portal, a native GTK window full screen, DeskEye beside it."""
    from tests.fixtures.gnome import open_native_window
    from tests.fixtures.kde import start_kde

    desktop = start_kde(folder / "kde")
    stops: list[Callable[[], None]] = [desktop.stop]
    try:
        window = open_native_window(desktop, "Report", "\n".join(LINES))
        stops.append(lambda: stop_process(window, timeout_s=5))
        home = deskeye_home(folder / "deskeye")
        settings = folder / "deskeye" / "settings.toml"
        settings.write_text(WORKER_SETTINGS + '[capture]\nportal = "screenshot"\n', encoding="utf-8")
        env = desktop.env(PYTHONPATH=str(REPO_ROOT), HF_HUB_OFFLINE="1", NO_AT_BRIDGE="1", **home)
        proc = subprocess.Popen([sys.executable, "-m", "deskeye.cli", "--settings", str(settings), "run",
                                 "--engine", "ocr"], cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        app = DeskEyeProcess(proc, desktop, [])
        stops.append(app.stop)
    except BaseException:
        for stop in reversed(stops):
            stop()
        raise
    return Running("static screen", app, proc.pid, lambda: [desktop.proc.pid],
                   "xdg-desktop-portal Screenshot (KDE)", stops)


def start_sway_case(folder: Path) -> Running:
    """sway headless with its portal, a native GTK window, DeskEye beside it (as root, as the tests run it)."""
    from tests.fixtures.sway import start_sway

    desktop = start_sway()
    stops: list[Callable[[], None]] = [desktop.stop]
    try:
        desktop.start_portal()
        desktop.open_window("Report", "org.example.report", text="\n".join(LINES))
        home = deskeye_home(folder / "deskeye")
        runtime = folder / "deskeye" / "run"
        runtime.mkdir(mode=0o700)
        settings = folder / "deskeye" / "settings.toml"
        settings.write_text(WORKER_SETTINGS, encoding="utf-8")
        env = desktop.env(PYTHONPATH=str(REPO_ROOT), HF_HUB_OFFLINE="1", NO_AT_BRIDGE="1", XDG_RUNTIME_DIR=str(runtime),
                          **home)
        proc = subprocess.Popen([sys.executable, "-m", "deskeye.cli", "--settings", str(settings), "run",
                                 "--engine", "ocr"], cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        app = DeskEyeProcess(proc, desktop, [])
        stops.append(app.stop)
    except BaseException:
        for stop in reversed(stops):
            stop()
        raise
    return Running("static screen", app, proc.pid,
                   lambda: [desktop.proc.pid, *(service.pid for service in desktop.services)],
                   "xdg-desktop-portal Screenshot (sway)", stops)


def private_runtime_folder(folder: Path) -> None:
    """A runtime folder (0700) for this process and the windows it starts, where none is set (root over ssh): GTK
    does not start without one."""
    if not os.environ.get("XDG_RUNTIME_DIR"):
        (folder / "runtime").mkdir(mode=0o700)
        os.environ["XDG_RUNTIME_DIR"] = str(folder / "runtime")


def start_cases(desktop: str, case: str, folder: Path) -> list[Running]:
    if desktop == "gnome":
        return [start_gnome_case(folder)]
    if desktop == "sway":
        return [start_sway_case(folder)]
    if desktop == "kwin":
        return [start_kwin_case(folder)]
    cases = CASES.values() if case == "both" else [CASES[case]]
    running: list[Running] = []
    try:
        for name, with_clock in cases:
            running.append(start_x11(with_clock, name))
    except BaseException:
        for each in running:
            each.stop()
        raise
    return running


def measure(running: list[Running], window_s: float, desktop: str, profile_out: Path | None = None) -> list[dict]:
    for each in running:
        if not each.app.read_until("deskeye: watching", READY_TIMEOUT_S):
            raise RuntimeError(f"deskeye run on {desktop} did not start watching:\n{''.join(each.app.output)}")
        keep_reading(each.app)
    start = {id(each): (settle(each.app), cpu_now(each)) for each in running}
    spies = profile(running, window_s, profile_out)
    time.sleep(window_s)
    load_1min = os.getloadavg()[0]
    rows = []
    for each in running:
        count, cpu = each.app.chat_requests(), cpu_now(each)
        before = start[id(each)]
        percent = {key: round(100 * (cpu[key] - before[1][key]) / window_s, 2) for key in cpu}
        rows.append({"desktop": desktop, "case": each.case, "capture": each.backend, "window_s": window_s,
                     "cpu_percent_of_one_core": percent["tree"], "app_cpu_percent": percent["app"],
                     "worker_cpu_percent": percent["worker"], "desktop_cpu_percent": percent["desktop"],
                     "describes_per_minute": round((count - before[0]) * 60 / window_s, 2),
                     "load_1min": round(load_1min, 2), "desktop_programs": desktop_programs(each),
                     "app_said": [line.rstrip() for line in each.app.output if "deskeye: watching" not in line][-5:]})
    for spy in spies:
        spy.wait(60)
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'desktop':<7} {'case':<22} {'window s':>8} {'CPU % (app+worker)':>19} {'app %':>6} {'worker %':>8}"
          f" {'desktop %':>9} {'describes/min':>14} {'load 1 min':>10}")
    for row in rows:
        print(f"{row['desktop']:<7} {row['case']:<22} {row['window_s']:>8.0f} {row['cpu_percent_of_one_core']:>19.2f}"
              f" {row['app_cpu_percent']:>6.2f} {row['worker_cpu_percent']:>8.2f} {row['desktop_cpu_percent']:>9.2f}"
              f" {row['describes_per_minute']:>14.2f} {row['load_1min']:>10.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--desktop", choices=DESKTOPS, default="x11")
    parser.add_argument("--minutes", type=float, default=1.0)
    parser.add_argument("--case", choices=[*CASES, "both"], default=None,
                        help="x11 only (default: both); gnome and sway measure a static screen")
    parser.add_argument("--json-out", type=Path, default=DEFAULT_JSON_OUT)
    parser.add_argument("--profile", type=Path, default=None, metavar="PATH",
                        help="also sample the app with py-spy over the window (pip install py-spy): PATH.N.txt")
    args = parser.parse_args(argv)
    if args.profile is not None and not Path(sys.executable).with_name("py-spy").exists():
        parser.error(f"--profile needs py-spy beside {sys.executable}: install it with `pip install py-spy`")
    if args.desktop != "x11" and args.case not in (None, "static"):
        parser.error(f"--case {args.case}: on {args.desktop} only a static screen is measured")
    window_s = args.minutes * 60
    with tempfile.TemporaryDirectory(prefix="deskeye-app-idle-") as folder:
        private_runtime_folder(Path(folder))
        running = start_cases(args.desktop, args.case or "both", Path(folder))
        try:
            rows = measure(running, window_s, args.desktop, args.profile)
        finally:
            for each in running:
                each.stop()
    print_table(rows)
    write_result(args.json_out, {"desktop": args.desktop, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
