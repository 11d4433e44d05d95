"""The app's side of the process boundary: start `deskeye-worker`, wait until it serves, restart it if it dies.

`WorkerSupervisor.start()` launches the worker as a child process (`python -m inference_worker.cli`) on a
port chosen by the OS, with a state file in a private temporary folder; the worker writes its URL, a
per-launch API key and its limits there once it is listening (deskeye/worker/launch.py, deskeye/worker/endpoint.py). The supervisor then polls GET /health until it answers 200.
A monitor thread watches the child: when it dies it is restarted with exponential backoff, at most
`worker.max_restarts` times within `worker.restart_window_s`; after that the state is "down" and
`endpoint()` raises `WorkerUnavailable` with the worker's last output lines. While it serves, the monitor
also probes GET /health (`HealthProbe`): a worker that stops answering (hung, deadlocked, SIGSTOPped) is
reported "unresponsive" after `max_missed` probes in a row, killed (SIGKILL: a stopped process cannot act on
SIGTERM) and restarted the same way as one that died.

With `worker.url` set no process is run: `endpoint()` returns that URL and key (state "external"), so an
external OpenAI-compatible server is used through exactly the same client code.

`stop()` is for good: any thread may call it, at any moment, any number of times, and a `start()` after it (or
racing it) starts nothing. The state folder goes when the supervisor stops, when it gives up on the worker, and with
`kill()` (an exit that cannot wait, deskeye/lifecycle.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from deskeye.errors import WorkerUnavailable
from deskeye.lifecycle import kill_on_exit_now
from deskeye.settings import Settings, worker_api_key
from deskeye.worker.endpoint import Endpoint, answers_health, external_base_url, read_endpoint
from deskeye.worker.launch import die_with_parent_thread, worker_command

log = logging.getLogger(__name__)

STARTING, READY, RESTARTING, DOWN, EXTERNAL, STOPPED = "starting", "ready", "restarting", "down", "external", "stopped"
UNRESPONSIVE = "unresponsive"    # serving, then stopped answering its health probe: being killed and restarted
MAX_OUTPUT_LINES = 40            # the worker's last lines kept for error messages
POLL_INTERVAL_S = 0.1
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
STOP_GRACE_S = 3.0               # SIGTERM, then SIGKILL after this long (a worker loading a model may not stop
                                 # sooner, and nothing of it is lost: the app is stopping)
STOP_TIMEOUT_S = 5.0             # the most any other wait while stopping takes


@dataclass(frozen=True)
class HealthProbe:
    """How a serving worker is checked: GET /health every `interval_s`, each with `timeout_s`; `max_missed`
    probes in a row without an answer mean it hangs. Detection takes at most about
    `max_missed * (interval_s + timeout_s)` (~10 s by default); a busy worker still answers /health at once.
    Each probe costs the idle worker and app CPU (a probe a second was ~0.4 % of a core): every 3 s, two missed."""
    interval_s: float = 3.0
    timeout_s: float = 2.0
    max_missed: int = 2

    def __post_init__(self):
        if not self.interval_s > 0 or not self.timeout_s > 0:
            raise ValueError(f"HealthProbe interval_s and timeout_s must be > 0; got {self.interval_s}, "
                             f"{self.timeout_s}")
        if not isinstance(self.max_missed, int) or self.max_missed < 1:
            raise ValueError(f"HealthProbe.max_missed must be an integer >= 1; got {self.max_missed!r}")

    @property
    def max_detection_s(self) -> float:
        return self.max_missed * (self.interval_s + self.timeout_s)


class WorkerSupervisor:
    def __init__(self, settings: Settings, *, on_state_change: Callable[[str], None] | None = None,
                 probe: HealthProbe = HealthProbe(), temp_root: Path | None = None):
        self.settings = settings
        self.temp_root = temp_root       # where the state folder goes (None: the system temp folder)
        self.on_state_change = on_state_change or (lambda state: None)
        self.probe = probe
        self.is_external = bool(settings.worker.url)
        self.num_restarts = 0
        self.num_hangs = 0               # workers killed because they stopped answering /health
        self._state = EXTERNAL if self.is_external else STOPPED
        self._endpoint: Endpoint | None = None
        self._failure: WorkerUnavailable | None = None
        self._proc: subprocess.Popen | None = None
        self._output: deque[str] = deque(maxlen=MAX_OUTPUT_LINES)
        self._restart_times: deque[float] = deque()
        self._generation = 0
        self._cond = threading.Condition()
        self._stop = threading.Event()   # set once, by stop(); never cleared
        self._lifecycle = threading.RLock()   # start() and stop() decide one after the other
        self._monitor: threading.Thread | None = None
        self._readers: list[threading.Thread] = []
        self._tmp_dir: Path | None = None
        kill_on_exit_now(self)

    # ------------------------------------------------------------------ public

    @property
    def state(self) -> str:
        return self._state

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    @property
    def state_dir(self) -> Path | None:
        """The private folder holding the worker's state file (None before start / for external servers)."""
        return self._tmp_dir

    def last_output(self) -> list[str]:
        """The worker's last output lines (stdout and stderr), oldest first."""
        return list(self._output)

    def start(self, *, wait: bool = True) -> None:
        """Launch the worker; with `wait`, block until it serves (raises WorkerUnavailable if it cannot start).

        After `stop()` (or racing it) nothing is launched: with `wait` it raises WorkerUnavailable, "not running"."""
        if self.is_external:
            self._set_state(EXTERNAL)
            return
        with self._lifecycle:
            if self._monitor is not None:
                raise RuntimeError("WorkerSupervisor.start() was already called.")
            if self._stop.is_set():
                log.info("the worker is not started: the supervisor was stopped first")
            else:
                self._tmp_dir = Path(tempfile.mkdtemp(prefix="deskeye-worker-", dir=self.temp_root))
                self._set_state(STARTING)
                self._monitor = threading.Thread(target=self._run, name="deskeye-worker-monitor", daemon=True)
                self._monitor.start()
        if wait:
            self.endpoint(self.settings.worker.startup_timeout_s + 5)

    def endpoint(self, timeout_s: float | None = None) -> Endpoint:
        """The worker's URL and key once it serves. Raises WorkerUnavailable if it is down or not ready in time."""
        if self.is_external:
            return Endpoint(external_base_url(self.settings.worker.url), worker_api_key(self.settings.worker),
                            self.settings.worker.remote_model)
        timeout_s = self.settings.worker.startup_timeout_s if timeout_s is None else timeout_s
        with self._cond:
            self._cond.wait_for(lambda: self._state in (READY, DOWN, STOPPED), timeout=timeout_s)
            return self._current_endpoint(timeout_s)

    def recover(self, failed: Endpoint, timeout_s: float | None = None) -> Endpoint:
        """After a request to `failed` lost its connection: wait for the restarted worker and return it.

        Raises WorkerUnavailable when the worker stays down (or, for an external server, at once).
        """
        if self.is_external:
            raise WorkerUnavailable(f"Cannot reach the server at {failed.url}: is it running? "
                                    "(settings: worker.url)")
        timeout_s = self.settings.worker.startup_timeout_s if timeout_s is None else timeout_s
        self._wait_for_exit_if_dying(failed)
        with self._cond:
            self._cond.wait_for(lambda: self._state in (DOWN, STOPPED) or (
                self._state == READY and (self._endpoint != failed or self._proc.poll() is None)),
                timeout=timeout_s)
            return self._current_endpoint(timeout_s)

    def stop(self) -> None:
        """Stop for good: the monitor and the worker (SIGTERM, then SIGKILL after STOP_GRACE_S); remove the private
        state folder. Any thread, any time, any number of times; a later start() starts nothing."""
        with self._lifecycle:
            self._stop.set()
            monitor = self._monitor
        with self._cond:
            self._cond.notify_all()
        self._terminate(self._proc)
        if monitor is not None:
            monitor.join(timeout=STOP_GRACE_S + STOP_TIMEOUT_S)
        self._terminate(self._proc)      # in case the monitor launched one while stopping
        for reader in list(self._readers):
            reader.join(timeout=STOP_TIMEOUT_S)
        self._remove_state_folder()
        if not self.is_external:
            self._set_state(STOPPED)

    def kill(self) -> None:
        """SIGKILL the worker and remove the state folder at once, for an exit that cannot wait (lifecycle.exit_now).
        Takes no lock and waits for nothing: the thread holding one may be the stuck one, or the one interrupted."""
        proc = self._proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(OSError):
                os.kill(proc.pid, signal.SIGKILL)
        self._remove_state_folder()

    def __enter__(self) -> "WorkerSupervisor":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ state

    def _current_endpoint(self, timeout_s: float) -> Endpoint:
        """Under the lock: the ready endpoint, or the reason there is none."""
        if self._state == READY and self._endpoint is not None:
            return self._endpoint
        if self._state == DOWN and self._failure is not None:
            raise WorkerUnavailable(str(self._failure))
        if self._state == STOPPED:
            raise WorkerUnavailable("The worker is not running (the supervisor was stopped or never started).")
        raise WorkerUnavailable(f"The worker is not ready after {timeout_s:.0f} s (state: {self._state}). "
                                "A large model can take minutes to load; see worker.startup_timeout_s.")

    def _set_state(self, state: str, *, endpoint: Endpoint | None = None,
                   failure: WorkerUnavailable | None = None) -> None:
        with self._cond:
            changed = state != self._state
            self._state, self._endpoint, self._failure = state, endpoint, failure
            self._cond.notify_all()
        if changed:
            try:
                self.on_state_change(state)
            except Exception:                    # a broken callback must not stop the supervisor
                log.exception("on_state_change(%r) failed", state)

    def _wait_for_exit_if_dying(self, failed: Endpoint) -> None:
        """A dropped connection usually means the worker died: wait a moment for it to exit. If it still
        serves afterwards (a transient drop), `recover` returns the same endpoint."""
        with self._cond:
            proc = self._proc if self._endpoint == failed else None
        if proc is None:
            return
        try:
            proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            pass

    # ------------------------------------------------------------------ monitor thread

    def _run(self) -> None:
        """Launch, wait until ready, watch; restart with backoff on death. Ends when stopped or given up; then no
        worker runs and its state folder is removed."""
        try:
            failure = self._launch_until_ready()
            if failure is not None:
                self._set_state(DOWN, failure=failure)
                return
            while not self._stop.is_set():
                if self._proc is not None and self._proc.poll() is None:
                    self._watch_health(self._proc)
                    continue
                if not self._restart_after_death():
                    return
        except Exception as exc:                 # never die silently: report it as "down"
            log.exception("worker monitor failed")
            self._set_state(DOWN, failure=WorkerUnavailable(f"The worker monitor failed: {exc}"))
        finally:
            self._terminate(self._proc)
            self._remove_state_folder()

    def _watch_health(self, proc: subprocess.Popen) -> None:
        """Probe the serving worker until it exits, the supervisor stops, or it hangs (then kill it: the monitor
        loop restarts it like a dead one)."""
        missed = 0
        while not self._stop.is_set() and proc.poll() is None:
            if self._stop.wait(self.probe.interval_s):
                return
            endpoint = self._endpoint
            if endpoint is None or answers_health(endpoint.url, self.probe.timeout_s):
                missed = 0
                continue
            missed += 1
            if missed >= self.probe.max_missed and proc.poll() is None:
                log.warning("deskeye-worker (pid %d) did not answer GET /health %d times in a row; killing it",
                            proc.pid, missed)
                self.num_hangs += 1
                self._set_state(UNRESPONSIVE)
                proc.kill()
                proc.wait(timeout=STOP_TIMEOUT_S)
                return

    def _restart_after_death(self) -> bool:
        """The worker died: restart it (True) or give up and report "down" (False)."""
        code = self._proc.returncode if self._proc is not None else None
        log.warning("deskeye-worker exited (code %s); restarting", code)
        while not self._stop.is_set():
            now = time.monotonic()
            window_s = self.settings.worker.restart_window_s
            while self._restart_times and now - self._restart_times[0] > window_s:
                self._restart_times.popleft()
            if len(self._restart_times) >= self.settings.worker.max_restarts:
                self._set_state(DOWN, failure=self._failure_message(
                    f"The worker died {len(self._restart_times) + 1} times within {window_s:.0f} s "
                    f"(last exit code {code}); DeskEye stopped restarting it"))
                return False
            self._set_state(RESTARTING)
            backoff_s = min(FIRST_BACKOFF_S * 2 ** len(self._restart_times), MAX_BACKOFF_S)
            self._restart_times.append(now)
            self.num_restarts += 1
            if self._stop.wait(backoff_s):
                return False
            failure = self._launch_until_ready()
            if failure is None:
                return True
            code = self._proc.returncode if self._proc is not None else None
        return False

    def _launch_until_ready(self) -> WorkerUnavailable | None:
        """Start one worker and wait for /health == 200. None when ready, else why not."""
        state_file = self._tmp_dir / "worker.json"
        state_file.unlink(missing_ok=True)
        command = worker_command(self.settings, state_file)
        self._output.clear()
        log.info("starting the worker: %s", " ".join(command))
        env = {**os.environ, "ORT_DISABLE_TELEMETRY": "1"}   # onnxruntime phones home by default
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True, env=env,
                                preexec_fn=die_with_parent_thread())
        self._proc = proc
        self._start_reader(proc)
        if self._stop.is_set():
            self._terminate(proc)
            return None
        timeout_s = self.settings.worker.startup_timeout_s
        deadline = time.monotonic() + timeout_s
        while not self._stop.is_set():
            if proc.poll() is not None:
                self._join_readers()
                return self._failure_message(f"The worker exited with code {proc.returncode} while starting")
            endpoint = read_endpoint(state_file, self._generation + 1)
            if endpoint is not None:
                self._generation = endpoint.generation
                self._set_state(READY, endpoint=endpoint)
                return None
            if time.monotonic() > deadline:
                self._terminate(proc)
                return self._failure_message(f"The worker did not become ready within {timeout_s:.0f} s "
                                             "(settings: worker.startup_timeout_s)")
            self._stop.wait(POLL_INTERVAL_S)
        return None

    def _failure_message(self, what: str) -> WorkerUnavailable:
        lines = [line for line in self.last_output() if line.strip()][-12:]
        shown = "\n".join(f"  | {line}" for line in lines) or "  (it printed nothing)"
        return WorkerUnavailable(f"{what}. Its last output:\n{shown}\n"
                                 "Check worker.engine / worker.model in the settings, or run `deskeye doctor`.")

    # ------------------------------------------------------------------ child process

    def _start_reader(self, proc: subprocess.Popen) -> None:
        reader = threading.Thread(target=self._read_output, args=(proc,), name="deskeye-worker-output",
                                  daemon=True)
        reader.start()
        self._readers = [r for r in self._readers if r.is_alive()] + [reader]

    def _read_output(self, proc: subprocess.Popen) -> None:
        """Keep the worker's last lines; ends at EOF (when the worker exits)."""
        for raw in proc.stdout:
            line = raw.decode("utf-8", errors="replace").rstrip()
            self._output.append(line)
            log.debug("worker: %s", line)
        proc.stdout.close()

    def _join_readers(self) -> None:
        for reader in self._readers:
            reader.join(timeout=1.0)

    def _remove_state_folder(self) -> None:
        if self._tmp_dir is not None:
            shutil.rmtree(self._tmp_dir, ignore_errors=True)

    @staticmethod
    def _terminate(proc: subprocess.Popen | None) -> None:
        """SIGTERM, then SIGKILL after STOP_GRACE_S; reaped."""
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            log.warning("deskeye-worker (pid %d) did not stop within %.0f s of SIGTERM; killing it", proc.pid,
                        STOP_GRACE_S)
            proc.kill()
            proc.wait(timeout=STOP_TIMEOUT_S)

