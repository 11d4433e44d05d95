"""First words on the overlay: describe hotkey -> the OCR first look, and -> the model's whole answer.

    .venv/bin/python -m benchmarks.first_words [--runs 3] [--model PATH | --real-size | --url URL] [--json-out PATH]

The real app (`build_app`: Tk overlay, pynput hotkey pressed with xdotool, capture, its `deskeye-worker`
processes) on a private Xvfb 1920x1080, watching a text window in the default 800x600 region. Two cases, each
`--runs` times, one app each:
- two-stage (`worker.ocr_first = true`, the default): the OCR worker's first look, then the model's answer;
- one-stage (`worker.ocr_first = false`): what a user waited for before, the model's first streamed words.
One describe before the runs is not counted (in use, the app's first automatic describe is that one: both
workers' first request pays one-time costs). Before every run all lines of the window change, so no run reuses
an earlier frame (neither the worker's frame
reuse nor the OCR's recognition cache). Times are wall-clock seconds from just before `xdotool key` to the
moment the overlay's Tk thread has drawn the content (its `on_shown` callback). Where the first look's time goes:
the OCR worker's own answer to the same frame over HTTP, measured after the runs (the rest is the hotkey, the
grab, the PNG and the drawing).

The model: the tiny random Idefics3 fixture (built in a temp folder; it answers in a fraction of a second, so
its "final" row says little) unless `--model` names a model folder, `--real-size` asks for MiniCPM-V 4.6 at its
real size with random weights (the folder `benchmarks.real_size` caches, built first when missing: 2.6 GB), or
`--url` an external server. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from benchmarks._results import write_result

DEFAULT_JSON_OUT = Path("benchmarks/results/first_words.json")
REGION_GEOMETRY = "800x600+560+240"        # the default capture region on 1920x1080
NUM_LINES = 6
TARGET_FIRST_WORDS_S = 0.5
STARTUP_TIMEOUT_S = 900.0                  # a real-size model loads for minutes on a CPU
ANSWER_TIMEOUT_S = 600.0
_WORDS = ("invoice", "meeting", "budget", "draft", "review", "release", "calendar", "project", "status",
          "customer", "payment", "schedule", "network", "terminal", "editor", "agenda", "notes", "upload")


def screen_lines(run: int) -> list[str]:
    """The window's text for one run: different in every line from every other run's."""
    return [f"{_WORDS[(run * 7 + i * 3) % len(_WORDS)].title()} {run * 10 + i} "
            f"{_WORDS[(run * 5 + i) % len(_WORDS)]} {_WORDS[(run + i * 5) % len(_WORDS)]}" for i in range(NUM_LINES)]


class OverlayClock:
    """When the overlay drew each content of one describe, from the Tk thread's `on_shown`."""

    def __init__(self, overlay):
        self._overlay = overlay
        self._events: list[tuple[float, str]] = []
        self._done = threading.Event()
        overlay.on_shown = self._on_shown

    def _on_shown(self, content) -> None:
        if content is None:
            return
        self._events.append((time.perf_counter(), content.kind))
        if content.kind in ("answer", "error"):
            self._done.set()

    def press(self) -> dict:
        self._overlay.hide()
        self._overlay.wait_for(lambda shown: shown is None, 10)
        self._events.clear()
        self._done.clear()
        started = time.perf_counter()
        subprocess.run(["xdotool", "key", "ctrl+alt+d"], check=True, timeout=10)
        if not self._done.wait(ANSWER_TIMEOUT_S):
            raise RuntimeError(f"no answer within {ANSWER_TIMEOUT_S:.0f} s; shown: {self._events}")
        events = list(self._events)
        first_at, first_kind = events[0]
        final_at, final_kind = next(event for event in events if event[1] in ("answer", "error"))
        return {"first_words_s": round(first_at - started, 3), "first_kind": str(first_kind),
                "final_s": round(final_at - started, 3), "final_kind": str(final_kind)}


def run_case(name: str, worker: dict, runs: int, window, home: Path, *, first_screen: int) -> dict:
    from deskeye.compose import build_app
    from deskeye.settings import settings_from_dict

    settings = settings_from_dict({"capture": {"interval_s": 86_400.0}, "overlay": {"fade_after_s": 0.0},
                                   "worker": {"startup_timeout_s": STARTUP_TIMEOUT_S,
                                              "request_timeout_s": ANSWER_TIMEOUT_S, **worker},
                                   "hooks": {"enabled": False}}, config_dir=home / name)
    app = build_app(settings, use_tray=False, temp_root=home)
    app.start()
    try:
        app.supervisor.endpoint(STARTUP_TIMEOUT_S)
        if app.first_look is not None:
            app.first_look.supervisor.endpoint(STARTUP_TIMEOUT_S)
        clock = OverlayClock(app.overlay)
        clock.press()                      # not counted: the app's first automatic describe would do this one
        rows = []
        for run in range(runs):
            for index, line in enumerate(screen_lines(first_screen + run)):
                window.set_line(index, line)
            rows.append(clock.press())
            print(f"  {name} run {run + 1}: {rows[-1]}", flush=True)
        ocr_alone = ocr_request_s(app, window, first_screen + runs, runs) if app.first_look is not None else []
    finally:
        app.quit()
        app.wait(60)
    return {"case": name, "runs": rows, "ocr_request_s": ocr_alone}


def ocr_request_s(app, window, first_screen: int, runs: int) -> list[float]:
    """The OCR worker's own answer to a new frame of the region over HTTP, the model idle (the first look's main
    part; the frames are new to it, so its recognition cache does not help)."""
    from deskeye.prompt import DESCRIBE_QUESTION

    times = []
    for run in range(runs):
        for index, line in enumerate(screen_lines(first_screen + run)):
            window.set_line(index, line)
        png = app.grabber.grab().png()
        started = time.perf_counter()
        app.first_look.client.ask(DESCRIBE_QUESTION, png, [])
        times.append(round(time.perf_counter() - started, 3))
    app.grabber.close_thread()
    return times


def summary_row(case: dict) -> dict:
    first = [run["first_words_s"] for run in case["runs"]]
    final = [run["final_s"] for run in case["runs"]]
    row = {"case": case["case"], "first_words_s": first, "first_kind": [run["first_kind"] for run in case["runs"]],
           "final_s": final, "median_first_words_s": statistics.median(first),
           "median_final_s": statistics.median(final), "ocr_request_s": case["ocr_request_s"]}
    row["first_words_target"] = "MET" if row["median_first_words_s"] <= TARGET_FIRST_WORDS_S else "MISSED"
    return row


def print_table(rows: list[dict]) -> None:
    print(f"{'case':<11} {'first words s (3 runs)':>24} {'shown first':>12} {'final answer s':>22} "
          f"{'OCR alone s':>20} {'target 0.5 s':>12}")
    for row in rows:
        runs = " ".join(f"{v:.2f}" for v in row["first_words_s"])
        finals = " ".join(f"{v:.2f}" for v in row["final_s"])
        ocr = " ".join(f"{v:.2f}" for v in row["ocr_request_s"]) or "-"
        print(f"{row['case']:<11} {runs:>24} {row['first_kind'][0]:>12} {finals:>22} {ocr:>20} "
              f"{row['first_words_target']:>12}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help="a model folder for the local worker (default: the tiny Idefics3 fixture)")
    source.add_argument("--real-size", action="store_true",
                        help="MiniCPM-V 4.6 at its real size, random weights (benchmarks.real_size's cached folder)")
    source.add_argument("--url", help="an external OpenAI-compatible server for the model")
    parser.add_argument("--json-out", type=Path, default=DEFAULT_JSON_OUT)
    args = parser.parse_args()

    from tests.fixtures.processes import stop_process
    from tests.fixtures.tk_windows import open_test_window
    from tests.fixtures.xvfb import start_xvfb

    os.environ.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    with tempfile.TemporaryDirectory(prefix="first-words-") as tmp:
        home = Path(tmp)
        if args.url:
            worker, model = {"url": args.url}, args.url
        else:
            model = args.model or str(_real_size_model() if args.real_size else _tiny_model(home))
            worker = {"engine": "transformers", "model": model}
        xvfb, display = start_xvfb(1920, 1080)
        os.environ.update({"DISPLAY": display.name, "XDG_SESSION_TYPE": "x11"})
        window = open_test_window(display, "Notes - editor", REGION_GEOMETRY, lines=screen_lines(0))
        try:
            cases = [run_case("two-stage", {**worker, "ocr_first": True}, args.runs, window, home, first_screen=1),
                     run_case("one-stage", {**worker, "ocr_first": False}, args.runs, window, home,
                              first_screen=1 + 2 * args.runs)]
        finally:
            window.close()
            stop_process(xvfb, timeout_s=5)
    rows = [summary_row(case) for case in cases]
    print(f"model: {model}; CPU: {cpu_name()}, {os.cpu_count()} cores")
    print_table(rows)
    write_result(args.json_out, {"model": model, "cpu": cpu_name(), "cpu_count": os.cpu_count(), "target_first_words_s":
                                 TARGET_FIRST_WORDS_S, "rows": rows, "cases": cases})


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _real_size_model() -> Path:
    from benchmarks.real_size import REAL, default_cache_root, ensure_model
    return ensure_model(REAL, default_cache_root())


def _tiny_model(home: Path) -> Path:
    from tests.fixtures.tiny_models import build_tiny_idefics3
    return build_tiny_idefics3(home / "tiny-idefics3")


if __name__ == "__main__":
    main()
