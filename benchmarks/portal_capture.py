"""How fast DeskEye sees an 800x600 region change on Wayland: the portal's ScreenCast on GNOME, its Screenshot on sway
and GNOME, and mss on Xvfb beside them for reference. Each through DeskEye's own capture backend.

    .venv/bin/python -m benchmarks.portal_capture [--grabs 50] [--shots 15] [--static-s 10]
                                                  [--desktops gnome,sway,x11] [--json-out PATH]

On each desktop a real GTK program (a native Wayland window; an X11 one on Xvfb) fills the 1280x800 screen with one
colour, and from a signal on changes it every 100 ms (8 colours in turn), printing the monotonic time of each paint
(its draw handler: the damage, a moment before the compositor gets the new buffer). DeskEye's backend grabs the
region 240,100 800x600 and reads the colour in its middle.
- ScreenCast and mss: grabs one after the other (`--poll-ms` apart) until `--grabs` changes were seen. Two numbers:
  the grab call itself, and damage to frame: from the paint of a colour to the return of the first grab that shows
  it (it includes up to one poll interval and the call). First, the screen static for `--static-s`: how many frames
  the compositor sent meanwhile (frames come on damage: none expected).
  For ScreenCast also damage to stream: from the paint to the moment that frame reached DeskEye's appsink (the
  compositor, PipeWire and GStreamer's part; the rest is the poll and the grab).
- Screenshot: `--shots` grabs one after the other, each one portal call (a file written, read, decoded): the call.

On GNOME the measuring process runs inside the session's namespaces, as DeskEye must (tests/test_gnome_wayland.py),
with the user's consent played as the tests do. The wlr portal writes the fixed file /tmp/out.png: run one sway
benchmark at a time. Prints a table and writes JSON with the machine's load; on a busy machine latencies are upper
bounds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks._harness import percentile, rounded
from benchmarks._results import write_result

DEFAULT_JSON_OUT = Path("benchmarks/results/portal_capture.json")
DESKTOPS = ("gnome", "sway", "x11")
WIDTH, HEIGHT = 1280, 800
REGION = (240, 100, 800, 600)
# Colours far apart, none of them another one with red and blue swapped (a BGRx frame read as RGBx is no match).
PALETTE = ((220, 40, 40), (40, 200, 40), (230, 230, 40), (240, 140, 20), (140, 20, 90), (20, 90, 20),
           (250, 250, 250), (120, 120, 120))
REDRAW_MS = 100
INNER_TIMEOUT_S = 300.0
MAX_COLOUR_DISTANCE = 40

# The changing screen: a GTK 3 window of one colour, full screen; "go" on stdin starts a change every REDRAW_MS.
# Prints "shown", then "K T" for each paint of colour K % len(PALETTE) at monotonic time T. Quits when stdin closes.
WINDOW = r"""
import sys, threading, time, gi
gi.require_version("Gtk", "3.0")
from gi.repository import GLib, Gtk
PALETTE, REDRAW_MS = %r, %d
count = [0]
window = Gtk.Window(title="DeskEye capture benchmark")
area = Gtk.DrawingArea()
def draw(_widget, cr):
    r, g, b = PALETTE[count[0] %% len(PALETTE)]
    cr.set_source_rgb(r / 255, g / 255, b / 255)
    cr.paint()
    print(count[0], time.monotonic(), flush=True)
area.connect("draw", draw)
window.add(area)
window.set_default_size(%d, %d)
window.move(0, 0)
window.connect("map-event", lambda *a: print("shown", flush=True))
window.connect("destroy", Gtk.main_quit)
def tick():
    count[0] += 1
    area.queue_draw()
    return True
def stdin():
    for line in sys.stdin:
        if line.strip() == "go":
            GLib.idle_add(lambda: GLib.timeout_add(REDRAW_MS, tick) and False)
    GLib.idle_add(Gtk.main_quit)
threading.Thread(target=stdin, daemon=True).start()
window.fullscreen()
window.show_all()
Gtk.main()
""" % (PALETTE, REDRAW_MS, WIDTH, HEIGHT)


# ------------------------------------------------------------------ inside the desktop: the measuring process


class Paints:
    """The window's paints as it prints them: colour index -> times (read on a thread)."""

    def __init__(self, proc: subprocess.Popen):
        self.times: dict[int, list[float]] = {i: [] for i in range(len(PALETTE))}
        self.lock = threading.Lock()
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            parts = line.split()
            if len(parts) == 2 and parts[0].isdigit():
                with self.lock:
                    self.times[int(parts[0]) % len(PALETTE)].append(float(parts[1]))

    def last_before(self, colour: int, moment: float, wait_s: float = 0.2) -> float | None:
        """When `colour` was last painted before `moment` (its line may come a moment after the frame did)."""
        deadline = time.monotonic() + wait_s
        while True:
            with self.lock:
                found = [t for t in self.times[colour] if t <= moment]
            if found or time.monotonic() > deadline:
                return found[-1] if found else None
            time.sleep(0.005)


def colour_of(image) -> int | None:
    pixel = image.getpixel((image.width // 2, image.height // 2))[:3]
    distances = [sum(abs(a - b) for a, b in zip(pixel, colour)) for colour in PALETTE]
    best = min(range(len(PALETTE)), key=distances.__getitem__)
    return best if distances[best] <= MAX_COLOUR_DISTANCE else None


def open_backend(kind: str):
    from deskeye.see.backends import MssBackend
    from deskeye.see.portal_screencast import PortalScreenCastBackend
    from deskeye.see.portal_screenshot import PortalScreenshotBackend
    from deskeye.see.session import Session

    backend = {"screencast": PortalScreenCastBackend, "screenshot": PortalScreenshotBackend,
               "mss": MssBackend}[kind]
    return backend(Session.detect())


def inner(kind: str, num_grabs: int, static_s: float, poll_s: float) -> dict:
    """Start the window, open the backend, measure; returns what was measured (printed as JSON by main)."""
    from deskeye.see.geometry import Rect

    window = subprocess.Popen([sys.executable, "-c", WINDOW], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    try:
        said = [window.stdout.readline() for _ in range(1)]
        while said[-1] and said[-1].strip() != "shown" and len(said) < 20:     # a first paint may come before
            said.append(window.stdout.readline())
        if said[-1].strip() != "shown":
            raise RuntimeError(f"the benchmark's GTK window did not show: {''.join(said)}")
        paints = Paints(window)
        time.sleep(1.0)                                   # mapped and painted full screen
        backend = open_backend(kind)
        try:
            result = {"backend": backend.name}
            rect = Rect(*REGION)
            if kind != "screenshot":
                backend.grab(rect)
                frames = getattr(backend, "frames_received", lambda: (None, None))
                before = frames()[0]
                time.sleep(static_s)
                after = frames()[0]
                result["static_s"] = static_s
                result["frames_while_static"] = None if before is None else after - before
            window.stdin.write("go\n")
            window.stdin.flush()
            time.sleep(0.3)
            result.update(grab_changes(backend, rect, paints, num_grabs, poll_s) if kind != "screenshot" else
                          grab_one_by_one(backend, rect, num_grabs))
            return result
        finally:
            backend.close()
    finally:
        window.stdin.close()
        try:
            window.wait(10)
        except subprocess.TimeoutExpired:
            window.kill()
            window.wait()


def grab_changes(backend, rect, paints: Paints, num_changes: int, poll_s: float) -> dict:
    """Grab until `num_changes` new colours were seen: each grab call's time, and each change's paint-to-grab."""
    call_ms, change_ms, arrival_ms, unmatched = [], [], [], 0
    frames = getattr(backend, "frames_received", lambda: (None, None))
    seen = colour_of(backend.grab(rect))
    deadline = time.monotonic() + max(30.0, num_changes * REDRAW_MS / 1000 * 4)
    while len(change_ms) + unmatched < num_changes and time.monotonic() < deadline:
        started = time.monotonic()
        image = backend.grab(rect)
        returned = time.monotonic()
        call_ms.append((returned - started) * 1000)
        arrived = frames()[1]
        colour = colour_of(image)
        if colour is not None and colour != seen:
            seen = colour
            painted = paints.last_before(colour, returned)
            if painted is None:
                unmatched += 1
            else:
                change_ms.append((returned - painted) * 1000)
                if arrived is not None:
                    arrival_ms.append((arrived - painted) * 1000)
        time.sleep(poll_s)
    return {"call_ms": call_ms, "change_ms": change_ms, "arrival_ms": arrival_ms, "unmatched_changes": unmatched}


def grab_one_by_one(backend, rect, num_grabs: int) -> dict:
    call_ms, colours = [], set()
    for _ in range(num_grabs):
        started = time.monotonic()
        image = backend.grab(rect)
        call_ms.append((time.monotonic() - started) * 1000)
        colours.add(colour_of(image))
    return {"call_ms": call_ms, "change_ms": [], "colours_seen": len(colours - {None})}


# ------------------------------------------------------------------ outside: the desktops


def run_inner(argv_prefix: list[str], run, env: dict[str, str], kind: str, args) -> dict:
    """The measuring process (this module with --inner) through `run` (in the desktop's session); its JSON."""
    from tests.fixtures.deskeye_process import REPO_ROOT

    argv = [*argv_prefix, sys.executable, "-m", "benchmarks.portal_capture", "--inner", kind, "--grabs",
            str(args.shots if kind == "screenshot" else args.grabs), "--static-s", str(args.static_s),
            "--poll-ms", str(args.poll_ms)]
    done = run(argv, INNER_TIMEOUT_S, cwd=REPO_ROOT, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the {kind} measurement failed ({done.returncode}):\n{done.stdout[-2000:]}\n"
                           f"{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def plain_run(argv: list[str], timeout_s: float, **kwargs) -> subprocess.CompletedProcess:
    from tests.fixtures.processes import run_as_group
    return run_as_group(argv, timeout_s, **kwargs)


def measure_gnome(folder: Path, args) -> list[tuple[str, dict]]:
    from benchmarks.app_idle import deskeye_home
    from tests.fixtures.deskeye_process import REPO_ROOT
    from tests.fixtures.gnome import start_gnome

    desktop = start_gnome(folder / "gnome")
    try:
        desktop.allow_screenshots()
        results = []
        for kind in ("screencast", "screenshot"):
            token = desktop.consent_to_screencast() if kind == "screencast" else ""
            home = deskeye_home(folder / f"deskeye-{kind}", token)
            env = desktop.env(PYTHONPATH=str(REPO_ROOT), NO_AT_BRIDGE="1", GDK_BACKEND="wayland", **home)
            results.append(("gnome", run_inner([], desktop.run, env, kind, args)))
        return results
    finally:
        desktop.stop()


def measure_sway(folder: Path, args) -> list[tuple[str, dict]]:
    from benchmarks.app_idle import deskeye_home
    from tests.fixtures.deskeye_process import REPO_ROOT
    from tests.fixtures.sway import start_sway

    desktop = start_sway()
    try:
        desktop.start_portal()
        env = desktop.env(PYTHONPATH=str(REPO_ROOT), NO_AT_BRIDGE="1", GDK_BACKEND="wayland",
                          **deskeye_home(folder / "deskeye-sway"))
        env.pop("DISPLAY")
        return [("sway", run_inner([], plain_run, env, "screenshot", args))]
    finally:
        desktop.stop()


def measure_x11(folder: Path, args) -> list[tuple[str, dict]]:
    from tests.fixtures.deskeye_process import REPO_ROOT
    from tests.fixtures.processes import stop_process
    from tests.fixtures.xvfb import start_xvfb

    xvfb, display = start_xvfb(WIDTH, HEIGHT)
    try:
        env = display.env(PYTHONPATH=str(REPO_ROOT), NO_AT_BRIDGE="1", GDK_BACKEND="x11")
        env.pop("WAYLAND_DISPLAY", None)
        return [("x11", run_inner([], plain_run, env, "mss", args))]
    finally:
        stop_process(xvfb)


def summary(desktop: str, measured: dict) -> dict:
    def stats(values: list[float]) -> dict:
        return {"n": len(values), "p50_ms": rounded(percentile(values, 0.5), 1),
                "p90_ms": rounded(percentile(values, 0.9), 1)}
    return {"desktop": desktop, "backend": measured["backend"], "grab_call": stats(measured["call_ms"]),
            "damage_to_frame": stats(measured["change_ms"]),
            "damage_to_stream": stats(measured.get("arrival_ms", [])),
            "frames_while_static": measured.get("frames_while_static"), "static_s": measured.get("static_s"),
            "unmatched_changes": measured.get("unmatched_changes"), "raw": measured}


def print_table(rows: list[dict], load: dict) -> None:
    def cell(value) -> str:
        return "n/a" if value is None else f"{value:.1f}"
    print(f"{'desktop':<7} {'backend':<38} {'grabs':>5} {'call p50':>8} {'p90':>6} {'changes':>7}"
          f" {'damage->frame p50':>17} {'p90':>6} {'(in stream p50':>14} {'p90)':>5} {'frames while static':>19}")
    for row in rows:
        call, change, stream = row["grab_call"], row["damage_to_frame"], row["damage_to_stream"]
        frames = row["frames_while_static"]
        static = "n/a" if frames is None else f"{frames} in {row['static_s']:g} s"
        print(f"{row['desktop']:<7} {row['backend']:<38} {call['n']:>5} {cell(call['p50_ms']):>8} "
              f"{cell(call['p90_ms']):>6} {change['n']:>7} {cell(change['p50_ms']):>17} {cell(change['p90_ms']):>6}"
              f" {cell(stream['p50_ms']):>14} {cell(stream['p90_ms']):>5} {static:>19}")
    print(f"load average (1 min) before {load['before']:.2f}, after {load['after']:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grabs", type=int, default=50, help="changes to see through ScreenCast and mss")
    parser.add_argument("--shots", type=int, default=15, help="grabs through the Screenshot portal")
    parser.add_argument("--static-s", type=float, default=10.0)
    parser.add_argument("--poll-ms", type=float, default=5.0)
    parser.add_argument("--desktops", default=",".join(DESKTOPS))
    parser.add_argument("--json-out", type=Path, default=DEFAULT_JSON_OUT)
    parser.add_argument("--inner", choices=("screencast", "screenshot", "mss"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inner:
        print(json.dumps(inner(args.inner, args.grabs, args.static_s, args.poll_ms / 1000)), flush=True)
        return 0
    desktops = [name.strip() for name in args.desktops.split(",") if name.strip()]
    unknown = set(desktops) - set(DESKTOPS)
    if unknown or not desktops:
        parser.error(f"--desktops: choose among {', '.join(DESKTOPS)}")
    measures = {"gnome": measure_gnome, "sway": measure_sway, "x11": measure_x11}
    load = {"before": os.getloadavg()[0]}
    rows = []
    with tempfile.TemporaryDirectory(prefix="deskeye-portal-capture-") as folder:
        if not os.environ.get("XDG_RUNTIME_DIR"):             # GTK does not start without one
            (Path(folder) / "runtime").mkdir(mode=0o700)
            os.environ["XDG_RUNTIME_DIR"] = str(Path(folder) / "runtime")
        for name in desktops:
            rows += [summary(desktop, measured) for desktop, measured in measures[name](Path(folder), args)]
    load["after"] = os.getloadavg()[0]
    print_table(rows, load)
    write_result(args.json_out, {"region": list(REGION), "redraw_ms": REDRAW_MS, "poll_ms": args.poll_ms,
                                 "load_1min": {k: round(v, 2) for k, v in load.items()}, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
