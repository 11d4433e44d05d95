"""WorkerSupervisor + WorkerClient against a real `deskeye-worker --engine ocr` subprocess.

A worker killed with SIGKILL is restarted and the next question is answered; a question in flight when
it dies is retried and answered; stop() leaves no child process; a worker that cannot start, or keeps
dying, is reported with its own last output lines.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import psutil
import pytest

from deskeye.worker.client import WorkerClient
from deskeye.errors import WorkerUnavailable
from deskeye.settings import Settings, with_overrides
from deskeye.worker.supervisor import HealthProbe, WorkerSupervisor
from tests.fixtures.polling import wait_until
from tests.fixtures.text_image import render_text_png

pytestmark = [pytest.mark.subprocess]

WORDS = ["Quarterly", "budget", "review"]


def ocr_settings(**worker) -> Settings:
    return with_overrides(Settings(), worker={"engine": "ocr", "startup_timeout_s": 60.0,
                                              "request_timeout_s": 60.0, **worker})


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def text_png() -> bytes:
    return render_text_png(["Quarterly budget review", "Meeting at 3pm"])


@pytest.fixture(scope="module")
def running():
    """One supervised OCR worker for the module, with the states it went through."""
    states: list[str] = []
    supervisor = WorkerSupervisor(ocr_settings(), on_state_change=states.append)
    supervisor.start()
    client = WorkerClient(supervisor, supervisor.settings)
    yield supervisor, client, states
    client.close()
    supervisor.stop()


def _children_in(state_dir) -> list[psutil.Process]:
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if str(state_dir) in " ".join(child.cmdline()):
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


@pytest.mark.slow
def test_start_waits_until_the_worker_serves(running):
    supervisor, _, states = running
    endpoint = supervisor.endpoint(timeout_s=1)
    assert supervisor.state == "ready" and states[:2] == ["starting", "ready"]
    assert endpoint.url.startswith("http://127.0.0.1:") and len(endpoint.api_key) >= 32
    assert endpoint.engine == "ocr"
    state_file = supervisor.state_dir / "worker.json"
    assert oct(state_file.stat().st_mode & 0o777) == "0o600"
    assert oct(supervisor.state_dir.stat().st_mode & 0o777) == "0o700"
    assert psutil.Process(supervisor.pid).is_running()


def test_ask_returns_the_text_ocr_read(running, text_png):
    _, client, _ = running
    answer = client.ask("What is on this screen?", text_png)
    assert answer.engine == "ocr"
    assert all(word.lower() in answer.summary.lower() for word in WORDS), answer
    assert answer.latency_ms > 0


@pytest.mark.slow
def test_sigkilled_worker_is_restarted_and_the_next_ask_succeeds(running, text_png):
    supervisor, client, states = running
    old_pid, old_endpoint, restarts = supervisor.pid, supervisor.endpoint(1), supervisor.num_restarts
    os.kill(old_pid, signal.SIGKILL)
    answer = client.ask("What is on this screen?", text_png)
    assert "budget" in answer.summary.lower()
    assert supervisor.num_restarts == restarts + 1
    assert supervisor.pid not in (None, old_pid)
    assert supervisor.endpoint(1) != old_endpoint
    assert "restarting" in states and states[-1] == "ready"


@pytest.mark.slow
def test_a_question_in_flight_when_the_worker_dies_is_retried(running):
    """The kill lands while the request is being served (checked: the ask has not returned yet)."""
    supervisor, client, _ = running
    big_png = render_text_png([f"Invoice number {i} overdue" for i in range(8)], width=1200)
    pid, restarts = supervisor.pid, supervisor.num_restarts
    worker = psutil.Process(pid)
    busy_from = sum(worker.cpu_times()[:2])
    result: dict = {}
    asker = threading.Thread(target=lambda: result.update(answer=client.ask("What is this?", big_png)))
    asker.start()
    deadline = time.monotonic() + 30
    while sum(worker.cpu_times()[:2]) - busy_from < 0.05 and time.monotonic() < deadline:
        time.sleep(0.01)                      # the worker starts decoding / reading the image
    was_in_flight = asker.is_alive()
    os.kill(pid, signal.SIGKILL)
    asker.join(timeout=90)
    assert was_in_flight, "the request finished before the kill; the test did not test anything"
    assert "invoice" in result["answer"].summary.lower()
    assert supervisor.num_restarts == restarts + 1 and supervisor.pid != pid


@pytest.mark.slow
def test_a_hung_worker_is_detected_killed_and_restarted(text_png):
    """SIGSTOP: the process lives, its socket still accepts connections, but nothing answers."""
    probe = HealthProbe(interval_s=0.3, timeout_s=0.7, max_missed=2)
    states: list[str] = []
    supervisor = WorkerSupervisor(ocr_settings(), on_state_change=states.append, probe=probe)
    supervisor.start()
    client = WorkerClient(supervisor, supervisor.settings)
    hung_pid = supervisor.pid
    try:
        os.kill(hung_pid, signal.SIGSTOP)
        deadline = time.monotonic() + probe.max_detection_s + 10     # a bound on detection, not a benchmark
        while "unresponsive" not in states and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "unresponsive" in states, f"a SIGSTOPped worker was not detected; states {states}"
        assert supervisor.num_hangs == 1
        endpoint = supervisor.endpoint(timeout_s=60)                 # restarted, with backoff
        assert supervisor.pid not in (None, hung_pid) and supervisor.num_restarts == 1
        assert not psutil.pid_exists(hung_pid) or psutil.Process(hung_pid).status() == psutil.STATUS_ZOMBIE
        assert states[states.index("unresponsive"):] == ["unresponsive", "restarting", "ready"]
        assert endpoint.generation >= 2
        assert "budget" in client.ask("What is on this screen?", text_png).summary.lower()
    finally:
        if psutil.pid_exists(hung_pid):
            os.kill(hung_pid, signal.SIGCONT)
        client.close()
        supervisor.stop()


@pytest.mark.slow
def test_stop_terminates_the_worker_and_leaves_no_child():
    supervisor = WorkerSupervisor(ocr_settings())
    supervisor.start()
    pid, state_dir = supervisor.pid, supervisor.state_dir
    assert _children_in(state_dir)
    supervisor.stop()
    assert supervisor.state == "stopped"
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert _children_in(state_dir) == [] and not state_dir.exists()
    with pytest.raises(WorkerUnavailable, match="not running"):
        supervisor.endpoint(timeout_s=0.1)


@pytest.mark.slow
def test_gives_up_after_max_restarts_with_the_workers_output():
    states: list[str] = []
    supervisor = WorkerSupervisor(ocr_settings(max_restarts=1), on_state_change=states.append)
    supervisor.start()
    try:
        os.kill(supervisor.pid, signal.SIGKILL)
        supervisor.recover(supervisor.endpoint(1), timeout_s=60)       # restart 1 of 1
        os.kill(supervisor.pid, signal.SIGKILL)
        with pytest.raises(WorkerUnavailable) as failure:
            supervisor.recover(supervisor.endpoint(1), timeout_s=60)
        assert supervisor.state == "down" and states[-1] == "down"
        assert "died 2 times" in str(failure.value) and "stopped restarting" in str(failure.value)
        assert "listening on http://127.0.0.1:" in str(failure.value)      # the worker's own last lines
        with pytest.raises(WorkerUnavailable, match="stopped restarting"):
            supervisor.endpoint(timeout_s=0.1)
        assert wait_until(lambda: not supervisor.state_dir.exists(), 5), "a given-up worker's folder was kept"
    finally:
        supervisor.stop()


@pytest.mark.slow
@pytest.mark.parametrize("wait", [False, True])
def test_a_start_after_stop_starts_nothing(tmp_path, monkeypatch, wait):
    """A stop is for good (the app quit while it was still starting): no worker, no folder, "not running"."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))      # its state folder would land here
    supervisor = WorkerSupervisor(ocr_settings())
    supervisor.stop()
    try:
        if wait:
            with pytest.raises(WorkerUnavailable, match="not running"):
                supervisor.start()
        else:
            supervisor.start(wait=False)
        assert not wait_until(lambda: _children_in(tmp_path), 2.0), "a worker was started after stop()"
        assert supervisor.state == "stopped" and supervisor.pid is None
        assert list(tmp_path.iterdir()) == []
        with pytest.raises(WorkerUnavailable, match="not running"):
            supervisor.endpoint(timeout_s=0.1)
    finally:
        supervisor.stop()


@pytest.mark.slow
def test_a_stop_racing_start_never_leaves_a_worker_or_a_folder(tmp_path, monkeypatch):
    """start() and stop() on two threads, the stop a little later each time: whichever wins, nothing is left."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for delay_s in (0.0, 0.0002, 0.001, 0.003, 0.01, 0.03, 0.1):
        supervisor = WorkerSupervisor(ocr_settings())
        starter = threading.Thread(target=supervisor.start, kwargs={"wait": False})
        starter.start()
        time.sleep(delay_s)
        supervisor.stop()
        starter.join(10)
        assert not wait_until(lambda: _children_in(tmp_path), 1.0), f"a worker outlived stop() (delay {delay_s} s)"
        assert supervisor.state == "stopped", f"state {supervisor.state!r} after stop() (delay {delay_s} s)"
        assert list(tmp_path.iterdir()) == [], f"a state folder outlived stop() (delay {delay_s} s)"


@pytest.mark.slow
def test_a_worker_that_cannot_start_is_reported_with_its_error(tmp_path):
    missing = tmp_path / "no-such-model"
    supervisor = WorkerSupervisor(ocr_settings(engine="transformers", model=str(missing)))
    try:
        with pytest.raises(WorkerUnavailable) as failure:
            supervisor.start()
    finally:
        supervisor.stop()
    message = str(failure.value)
    assert "exited with code 1 while starting" in message
    assert f"{missing}" in message and "does not exist" in message     # the worker's own error line
    assert supervisor.num_restarts == 0


def test_external_url_runs_no_process(monkeypatch):
    monkeypatch.setenv("DESKEYE_WORKER_API_KEY", "sk-from-env")
    with socket.socket() as probe:                # a port with nothing listening
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    settings = with_overrides(Settings(), worker={"url": f"{url}/v1/", "remote_model": "m"})
    supervisor = WorkerSupervisor(settings)
    supervisor.start()
    endpoint = supervisor.endpoint()
    assert supervisor.state == "external" and supervisor.pid is None and supervisor.state_dir is None
    assert (endpoint.url, endpoint.api_key, endpoint.model) == (url, "sk-from-env", "m")
    with pytest.raises(WorkerUnavailable, match=f"Cannot reach the server at {url}: is it running"):
        WorkerClient(supervisor, settings).ask("hi", None)
    supervisor.stop()


APP_SCRIPT = """
import sys, time
from deskeye.settings import Settings, with_overrides
from deskeye.worker.supervisor import HealthProbe, WorkerSupervisor
supervisor = WorkerSupervisor(with_overrides(Settings(), worker={"engine": "ocr", "startup_timeout_s": 60.0}))
supervisor.start()
print(supervisor.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux-only")
def test_a_killed_app_leaves_no_orphaned_worker(tmp_path):
    app = subprocess.Popen([sys.executable, "-c", APP_SCRIPT], stdout=subprocess.PIPE, text=True,
                           env={**os.environ, "TMPDIR": str(tmp_path)})    # its state folder lands here
    worker = None
    try:
        worker = psutil.Process(int(app.stdout.readline()))
        app.kill()                                    # SIGKILL: the app gets no chance to stop() anything
        app.wait(timeout=10)
        gone, alive = psutil.wait_procs([worker], timeout=15)
        assert alive == [], "the worker outlived the app that started it"
    finally:
        app.kill()
        app.wait(timeout=10)
        if worker is not None and worker.is_running():
            worker.kill()


def test_the_worker_settings_reach_the_worker_it_starts(tmp_path):
    """The app's [worker] settings (model, device, dtype, OCR grounding, timeout) become the child's config."""
    from deskeye.worker.launch import worker_command
    from inference_worker.cli import build_parser, config_from_args

    settings = with_overrides(Settings(), worker={
        "engine": "transformers", "model": str(tmp_path / "model"), "device": "cpu", "dtype": "fp32",
        "ground_with_ocr": True, "request_timeout_s": 42.0})
    command = worker_command(settings, tmp_path / "worker.json")
    assert command[:3] == [sys.executable, "-m", "inference_worker.cli"]
    config = config_from_args(build_parser().parse_args(command[3:]))
    assert (config.engine, config.model, config.device, config.dtype) == (
        "transformers", str(tmp_path / "model"), "cpu", "fp32")
    assert config.ground_with_ocr and config.request_timeout_s == 42.0 and config.port == 0
    assert config.state_file == tmp_path / "worker.json"

    plain = config_from_args(build_parser().parse_args(worker_command(Settings(), tmp_path / "w.json")[3:]))
    assert not plain.ground_with_ocr and plain.engine == "auto" and plain.model in (None, "")
