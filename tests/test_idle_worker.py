"""An idle worker sleeps: no thread of it wakes up on a timer while no request comes.

What is counted is wakeups, not CPU: a thread's voluntary context switches (Linux /proc), which grow each time it
blocks, so a loop that looks at a flag every 0.1 s adds ten a second however fast or loaded the machine is, and a
thread that waits for an event adds none. Stopping must still be immediate: an event, not a poll, ends each wait.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from inference_worker.serving.scheduler import BatchQueue
from tests.fixtures.polling import wait_until
from tests.fixtures.worker import REPO_ROOT, start_worker, worker_env

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

JOIN_TIMEOUT_S = 10.0
QUIET_S = 3.0                    # how long an idle thread is watched
MAX_IDLE_WAKEUPS = 5             # in QUIET_S: a stray timer or two; a 0.2 s poll alone makes 15
EXIT_TIMEOUT_S = 60.0


def wakeups(pid: int, tid: int | str = "") -> int:
    """Voluntary context switches of one thread (`tid`), or of every thread of process `pid`."""
    tasks = [Path(f"/proc/{pid}/task/{tid}")] if tid else list(Path(f"/proc/{pid}/task").iterdir())
    total = 0
    for task in tasks:
        try:
            total += int(re.search(r"^voluntary_ctxt_switches:\s+(\d+)", (task / "status").read_text(), re.M)[1])
        except (FileNotFoundError, ProcessLookupError):        # a thread that ended meanwhile
            continue
    return total


def is_sleeping(tid: int) -> bool:
    """Whether a thread of this process is blocked (state S)."""
    stat = Path(f"/proc/{os.getpid()}/task/{tid}/stat").read_text()
    return stat[stat.rindex(")") + 2] == "S"


def take_in_thread(queue: BatchQueue, window_s: float, stop: threading.Event):
    """`take` without `poll_s`, as the model thread calls it, once it blocks; returns (thread, result, its id)."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(queue.take(lambda: window_s, stop)), daemon=True)
    thread.start()
    tid = wait_until(lambda: thread.native_id, JOIN_TIMEOUT_S)
    assert wait_until(lambda: is_sleeping(tid), JOIN_TIMEOUT_S), "take() never blocked"
    return thread, result, tid


@pytest.mark.slow
def test_an_empty_take_sleeps_until_stop_wakes_it():
    queue, stop = BatchQueue(max_batch_size=4), threading.Event()
    thread, result, tid = take_in_thread(queue, 0.0, stop)
    before = wakeups(os.getpid(), tid)
    time.sleep(1.5)                                     # a 0.2 s poll wakes 7 times
    num_wakeups = wakeups(os.getpid(), tid) - before    # at most: the GIL it may still have waited for, once
    assert num_wakeups <= 2, f"take() woke up {num_wakeups} times on its own while the queue was empty"
    stop.set()
    queue.wake()
    thread.join(JOIN_TIMEOUT_S)
    assert not thread.is_alive() and result == [None]


def test_a_put_starts_the_window_and_the_batch_comes_at_its_end_without_polling():
    queue, stop = BatchQueue(max_batch_size=4), threading.Event()
    thread, result, tid = take_in_thread(queue, 0.3, stop)
    before = wakeups(os.getpid(), tid)
    queue.put("a")
    thread.join(JOIN_TIMEOUT_S)
    assert not thread.is_alive() and result[0].items == ["a"] and result[0].window_s == 0.3
    assert wakeups(os.getpid(), tid) - before <= 3      # the put, the window's end (and the GIL, at most once)


@pytest.mark.slow
@pytest.mark.subprocess
def test_an_idle_worker_sleeps_and_still_stops_at_once_on_sigterm(tmp_path):
    worker = start_worker(["--engine", "ocr"], tmp_path)
    try:
        time.sleep(1.0)                            # the readiness probe's connection closes
        before = wakeups(worker.proc.pid)
        time.sleep(QUIET_S)
        num_wakeups = wakeups(worker.proc.pid) - before
        assert num_wakeups <= MAX_IDLE_WAKEUPS, f"an idle worker woke {num_wakeups} times in {QUIET_S:g} s"
        status, _ = worker.request("GET", "/health", timeout_s=30)     # still serving after its sleep
        assert status == 200
    finally:
        assert worker.stop(EXIT_TIMEOUT_S) == 0, worker.log_text()


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_worker_whose_engine_fails_to_load_ends_on_its_own(tmp_path):
    """The main thread sleeps on the stop event alone: a failed load has to set it."""
    missing = tmp_path / "missing"
    done = subprocess.run([sys.executable, "-m", "inference_worker.cli", "--port", "0", "--state-file",
                           str(tmp_path / "worker.json"), "--engine", "openvino", "--model", str(missing)],
                          capture_output=True, text=True, cwd=REPO_ROOT, env=worker_env(), timeout=EXIT_TIMEOUT_S * 2)
    assert done.returncode == 1, done.stderr
    assert f"deskeye-worker: error: could not load the engine: {missing} is not a folder" in done.stderr
    assert not (tmp_path / "worker.json").exists()
