"""`deskeye run` (and a one-shot `deskeye describe`) ended at any moment, by SIGTERM or by the X server going away:
real processes on a real X server (Xvfb), each with its real `deskeye-worker --engine ocr` child.

Whatever ends it, within a bounded time the app is gone, so is every worker it started (their pids are collected
while the app lives), and no `deskeye-*` folder is left in its temporary folder (TMPDIR points at the test's own
folder, so only this run's folders are looked at).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from tests.fixtures.polling import wait_until
from tests.fixtures.processes import stop_process
from tests.fixtures.xvfb import XDisplay, start_xvfb

pytestmark = [pytest.mark.desktop, pytest.mark.subprocess]

REPO_ROOT = Path(__file__).resolve().parents[1]
STOP_BOUND_S = 10.0              # "stopped within 5 s" with room for a busy test machine; the bug: never
WORKER_GONE_S = 5.0              # after the app has exited
MAX_START_S = 60.0               # for `deskeye run` to start, its worker to appear, ...
SIGTERM_BIT = 1 << (signal.SIGTERM - 1)
STARTUP_MOMENTS = ["sigterm-handled", 0.05, 0.2, 0.35, 0.6, 1.0, 2.0, "run-folder", "worker", "ready"]


@dataclass
class DeskEyeRun:
    """A `deskeye` process with its output and every process it started (collected while it lives)."""
    proc: subprocess.Popen
    tmp_dir: Path
    output: list[str] = field(default_factory=list)
    descendants: dict[int, psutil.Process] = field(default_factory=dict)
    commands: dict[int, str] = field(default_factory=dict)        # pid -> command line, read while it lived
    started: float = field(default_factory=time.monotonic)

    def watch(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._collect_children, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)

    def _collect_children(self) -> None:
        try:
            app = psutil.Process(self.proc.pid)
            own_command = " ".join(app.cmdline())
            while self.proc.poll() is None:
                for child in app.children(recursive=True):
                    if child.pid not in self.commands:
                        self._add(child, own_command)
                time.sleep(0.01)
        except psutil.NoSuchProcess:
            pass

    def _add(self, child: psutil.Process, own_command: str) -> None:
        self.descendants.setdefault(child.pid, child)
        try:
            command = " ".join(child.cmdline())
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            return
        # Forked but not yet exec'd (the app's own command line), or in the middle of exec (the new image's command
        # line is not written yet: it reads empty, seen under load): read it again next time.
        if command and command != own_command:
            self.commands[child.pid] = command

    def workers(self) -> list[psutil.Process]:
        return [self.descendants[pid] for pid, command in list(self.commands.items())
                if "inference_worker.cli" in command]

    def catches_sigterm(self) -> bool:
        try:
            with open(f"/proc/{self.proc.pid}/status", encoding="ascii") as status:
                for line in status:
                    if line.startswith("SigCgt:"):
                        return bool(int(line.split()[1], 16) & SIGTERM_BIT)
        except FileNotFoundError:
            pass
        return False

    def text(self) -> str:
        return "".join(self.output)

    def alive_descendants(self) -> list[psutil.Process]:
        gone, alive = psutil.wait_procs(list(self.descendants.values()), timeout=WORKER_GONE_S)
        return [p for p in alive if _is_running(p)]

    def left_folders(self) -> list[str]:
        return sorted(p.name for p in self.tmp_dir.iterdir() if p.name.startswith("deskeye-"))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for child in self.descendants.values():
            if _is_running(child):
                child.kill()


def _is_running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def start_deskeye(display: XDisplay, tmp_path: Path, *args: str) -> DeskEyeRun:
    tmp_dir = tmp_path / "tmp"
    tmp_dir.mkdir()
    home = tmp_path / "home"
    settings = tmp_path / "settings.toml"
    settings.write_text("", encoding="utf-8")
    env = display.env(TMPDIR=str(tmp_dir), HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO_ROOT),
                      **{key: str(home / key.lower()) for key in
                         ("XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME")})
    proc = subprocess.Popen([sys.executable, "-m", "deskeye.cli", "--settings", str(settings), *args],
                            env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run = DeskEyeRun(proc, tmp_dir)
    run.watch()
    return run


def wait_for_moment(run: DeskEyeRun, moment) -> None:
    """Until `moment`: seconds after spawn, or an observed point of start-up."""
    if isinstance(moment, float):
        time.sleep(max(0.0, run.started + moment - time.monotonic()))
        return
    reached = {
        "sigterm-handled": run.catches_sigterm,           # the first instant a SIGTERM handler is in place
        "run-folder": lambda: any(run.tmp_dir.iterdir()),  # the app's first temporary folder exists
        "worker": lambda: bool(run.workers()),             # its worker process was started
        "ready": lambda: "deskeye: watching" in run.text(),
    }[moment]
    assert wait_until(lambda: reached() or run.proc.poll() is not None, MAX_START_S, interval_s=0.002) \
        and run.proc.poll() is None, f"deskeye never reached {moment!r}:\n{run.text()}"


def assert_everything_gone(run: DeskEyeRun, what: str) -> None:
    try:
        run.proc.wait(timeout=STOP_BOUND_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"deskeye still runs {STOP_BOUND_S:.0f} s after {what}:\n{run.text()}") from None
    alive = run.alive_descendants()
    assert alive == [], f"after {what}, deskeye's worker outlived it: {[p.cmdline() for p in alive]}"
    assert run.left_folders() == [], f"after {what}, deskeye left temporary folders behind"


@pytest.mark.slow
@pytest.mark.parametrize("moment", STARTUP_MOMENTS)
def test_sigterm_at_any_moment_of_start_up_stops_the_app_and_its_worker(xdisplay, tmp_path, moment):
    run = start_deskeye(xdisplay, tmp_path, "run", "--engine", "ocr")
    try:
        wait_for_moment(run, moment)
        run.proc.send_signal(signal.SIGTERM)
        assert_everything_gone(run, f"a SIGTERM at {moment!r}")
        assert "Traceback" not in run.text(), run.text()
        if moment == "ready":
            assert run.proc.returncode == 0, run.text()            # a clean stop
            assert run.workers(), "the test meant to stop a running worker, but none was started"
    finally:
        run.kill()


@pytest.fixture
def own_xvfb():
    """An X server of this test's own, which the test may stop or kill."""
    proc, display = start_xvfb(1280, 800)
    yield proc, display
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
    stop_process(proc, timeout_s=5)


@pytest.mark.slow
def test_a_second_sigterm_ends_an_app_whose_clean_stop_is_stuck(own_xvfb, tmp_path):
    """The X server freezes (SIGSTOP): the clean stop cannot finish (the threads that draw wait on it forever), so
    the first SIGTERM alone does not end the app at once; the second does, and still stops the worker and
    removes the folders."""
    xvfb, display = own_xvfb
    run = start_deskeye(display, tmp_path, "run", "--engine", "ocr")
    try:
        wait_for_moment(run, "ready")
        assert run.workers()
        os.kill(xvfb.pid, signal.SIGSTOP)
        run.proc.send_signal(signal.SIGTERM)
        time.sleep(2.0)
        assert run.proc.poll() is None, ("the app stopped at once despite the frozen X server: this test did not "
                                         f"reach a stuck stop\n{run.text()}")
        run.proc.send_signal(signal.SIGTERM)
        assert_everything_gone(run, "a second SIGTERM")
        assert run.proc.returncode == 128 + signal.SIGTERM, run.text()
        assert "SIGTERM again while stopping: stopping now." in run.text()
    finally:
        run.kill()


@pytest.mark.slow
def test_the_x_server_going_away_stops_the_app_and_its_worker_and_removes_its_folders(own_xvfb, tmp_path):
    xvfb, display = own_xvfb
    run = start_deskeye(display, tmp_path, "run", "--engine", "ocr")
    try:
        wait_for_moment(run, "ready")
        workers = run.workers()
        assert workers and run.left_folders(), "the app runs with a worker and its temporary folder"
        xvfb.kill()
        xvfb.wait()
        assert_everything_gone(run, "the X server went away")
        assert run.proc.returncode == 1, run.text()
        assert f"deskeye: lost the X display {display.name}" in run.text()
        assert "Traceback" not in run.text(), run.text()
    finally:
        run.kill()


@pytest.mark.slow
def test_sigterm_while_a_one_shot_command_starts_its_worker_leaves_nothing(xdisplay, tmp_path):
    """`deskeye describe`: SIGTERM while it waits for the worker it started for one answer."""
    from tests.fixtures.text_image import render_text_png

    image = tmp_path / "screen.png"
    image.write_bytes(render_text_png(["Quarterly budget review"]))
    run = start_deskeye(xdisplay, tmp_path, "describe", "--image", str(image), "--engine", "ocr")
    try:
        wait_for_moment(run, "worker")
        run.proc.send_signal(signal.SIGTERM)
        assert_everything_gone(run, "a SIGTERM while the worker starts")
        assert run.proc.returncode == 128 + signal.SIGTERM, run.text()
        assert "Traceback" not in run.text(), run.text()
    finally:
        run.kill()
