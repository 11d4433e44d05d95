"""What the benchmarks share: synthetic screenshots, the servers under test (and what their processes use), and
latency statistics. The load they put on a server is benchmarks/_load.py.

Servers run as subprocesses; the context managers and ServerPool here stop them on every exit path (Ctrl-C too).
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import io
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator

SCREEN_SIZE = (800, 600)
SERVE_START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 15.0
POLL_INTERVAL_S = 0.1
_WORDS = ("build", "deploy", "invoice", "meeting", "report", "server", "budget", "draft", "review", "ticket",
          "error", "warning", "commit", "branch", "release", "calendar", "inbox", "project", "status", "update",
          "customer", "payment", "schedule", "backup", "network", "window", "terminal", "editor", "browser",
          "slides", "agenda", "notes", "search", "upload", "download", "settings", "profile", "message")
_UVICORN_URL = re.compile(r"Uvicorn running on http://([\w.\-\[\]:]+?):(\d+)")
_ERROR_LINE = re.compile(r"^\w*(Error|Exception)\b|\berror:", re.IGNORECASE)


# ---------------------------------------------------------------- frames

@functools.lru_cache(maxsize=4)
def _font(size_px: int):
    from PIL import ImageFont

    from tests.fixtures.text_image import font_path
    return ImageFont.truetype(font_path(), size_px)


def render_screen(seed: str, size: tuple[int, int] = SCREEN_SIZE):
    """A desktop-like screenshot (title bar, sidebar, text lines, buttons) whose text depends on `seed`."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    width, height = size
    image = Image.new("RGB", size, (250, 250, 250))
    draw = ImageDraw.Draw(image)
    draw.rectangle((0, 0, width, 34), fill=tuple(rng.randrange(40, 200) for _ in range(3)))
    draw.text((12, 7), _phrase(rng, 4).title(), fill="white", font=_font(18))
    draw.rectangle((0, 34, 170, height), fill=(232, 234, 238))
    for i in range(12):
        draw.text((14, 50 + i * 28), _phrase(rng, 1).capitalize(), fill=(60, 60, 60), font=_font(16))
    for i in range(16):
        draw.text((190, 52 + i * 30), _phrase(rng, rng.randrange(4, 9)), fill="black", font=_font(16))
    for i in range(2):
        box = (width - 230 + i * 110, height - 50, width - 130 + i * 110, height - 18)
        draw.rectangle(box, fill=(45, 110, 200))
        draw.text((box[0] + 12, box[1] + 6), _phrase(rng, 1), fill="white", font=_font(14))
    return image


def _phrase(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))


def with_cursor(image):
    """The same screenshot with a 3x16-pixel text cursor drawn: a frame that differs in a few pixels."""
    from PIL import ImageDraw

    changed = image.copy()
    ImageDraw.Draw(changed).rectangle((600, 84, 602, 99), fill="black")
    return changed


def dark_mode(image):
    """The screenshot with inverted colours: another frame for the KV cache (no pixel in common), cheaply."""
    from PIL import ImageOps
    return ImageOps.invert(image)


def to_png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=3)     # fast; size as the default level
    return buffer.getvalue()


def screen_png(seed: str) -> bytes:
    return to_png(render_screen(seed))


# ---------------------------------------------------------------- servers

@dataclass(frozen=True)
class Endpoint:
    """Where a server under test answers POST /v1/chat/completions."""
    name: str
    host: str
    port: int
    model: str                           # what requests put in their "model" field
    api_key: str = ""
    log_path: Path | None = None

    def headers(self) -> dict[str, str]:
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return {"Content-Type": "application/json", **auth}

    def log_text(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace") if self.log_path else ""


class ServerUnavailable(RuntimeError):
    """A server under test did not start or cannot serve the model; the message says why."""


def thread_env(num_threads: int) -> dict[str, str]:
    """Offline, unbuffered, and `num_threads` torch/BLAS threads: the environment of every server here."""
    from tests.fixtures.worker import worker_env
    threads = str(num_threads)
    return {**worker_env(), "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}


@contextlib.contextmanager
def _patched_environ(values: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def deskeye_worker(model: str, work_dir: Path, *, num_threads: int, device: str, max_batch_size: int,
                   extra_args: tuple[str, ...] = ()) -> Iterator[Endpoint]:
    """`python -m inference_worker.cli` serving `model` (tests/fixtures/worker.py starts and stops it; it
    inherits os.environ, which ServerPool sets to `thread_env` while servers start)."""
    from tests.fixtures.worker import start_worker

    args = ["--engine", "transformers", "--model", model, "--threads", str(num_threads), "--device", device,
            "--max-batch-size", str(max_batch_size), *extra_args]
    handle = start_worker(args, work_dir)
    try:
        processes = f" pp={extra_args[extra_args.index('--prepare-processes') + 1]}" \
            if "--prepare-processes" in extra_args else ""
        yield Endpoint(f"deskeye-worker bs={max_batch_size}{processes}", handle.host, handle.port, model,
                       handle.api_key, handle.log_path)
    finally:
        handle.stop()


def transformers_cli() -> str:
    """The `transformers` console script of this interpreter's environment."""
    found = shutil.which("transformers", path=str(Path(sys.executable).parent)) or shutil.which("transformers")
    if not found:
        raise ServerUnavailable("the `transformers` command was not found next to this Python "
                                "(transformers >= 5 installs it)")
    return found


@contextlib.contextmanager
def transformers_serve(model: str, work_dir: Path, *, num_threads: int, device: str,
                       options: tuple[str, ...]) -> Iterator[Endpoint]:
    """`transformers serve MODEL --port 0 ...` with the model preloaded; the port is read from uvicorn's log."""
    work_dir.mkdir(parents=True, exist_ok=True)
    log_path = work_dir / "transformers_serve.log"
    command = [transformers_cli(), "serve", model, "--host", "127.0.0.1", "--port", "0", "--device", device,
               *options]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=thread_env(num_threads), start_new_session=True)
    try:
        host, port = _wait_for_uvicorn(proc, log_path)
        endpoint = Endpoint("transformers serve", host, port, model, log_path=log_path)
        _wait_until_healthy(endpoint, proc)
        yield endpoint
    finally:
        stop_process(proc)


def _wait_for_uvicorn(proc: subprocess.Popen, log_path: Path) -> tuple[str, int]:
    deadline = time.monotonic() + SERVE_START_TIMEOUT_S
    while time.monotonic() < deadline:
        text = log_path.read_text(encoding="utf-8", errors="replace")
        match = _UVICORN_URL.search(text)
        if match:
            return match.group(1), int(match.group(2))
        if proc.poll() is not None:
            raise ServerUnavailable(f"it exited with status {proc.returncode} before serving: {log_tail(text)}")
        time.sleep(POLL_INTERVAL_S)
    raise ServerUnavailable(f"no 'Uvicorn running on' line within {SERVE_START_TIMEOUT_S:.0f} s: "
                            f"{log_tail(log_path.read_text(encoding='utf-8', errors='replace'))}")


def _wait_until_healthy(endpoint: Endpoint, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + SERVE_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerUnavailable(f"it exited with status {proc.returncode}: {log_tail(endpoint.log_text())}")
        with contextlib.suppress(OSError):
            conn = http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=5)
            try:
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            finally:
                conn.close()
        time.sleep(POLL_INTERVAL_S)
    raise ServerUnavailable(f"GET /health did not answer 200 within {SERVE_START_TIMEOUT_S:.0f} s")


class ServerPool:
    """The servers under test by name. `start_all` starts them together (faster; every server holds its own
    copy of the model); otherwise each starts when first asked for, and `stop` frees it after its part.
    While a server starts, os.environ is `thread_env(num_threads)` (set and restored by this thread only).
    `close` stops whatever is running, also after Ctrl-C."""

    def __init__(self, factories: dict[str, Callable[[], ContextManager[Endpoint]]], *, num_threads: int):
        self._factories = factories
        self._num_threads = num_threads
        self._stacks = {name: contextlib.ExitStack() for name in factories}
        self._started: dict[str, Endpoint | BaseException] = {}

    def start_all(self, while_waiting: Callable[[], None] = lambda: None) -> None:
        with _patched_environ(thread_env(self._num_threads)):       # restored once every start has ended
            pool = ThreadPoolExecutor(len(self._factories), thread_name_prefix="bench-start")
            try:
                futures = {name: pool.submit(self._start, name) for name in self._factories}
                while_waiting()
                wait(futures.values())
            finally:
                pool.shutdown(wait=True)

    def endpoint(self, name: str) -> Endpoint:
        """The running server `name` (started now if it is not); raises why it could not start."""
        if name not in self._started:
            with _patched_environ(thread_env(self._num_threads)):
                self._start(name)
        found = self._started[name]
        if isinstance(found, BaseException):
            raise found
        return found

    def stop(self, name: str) -> None:
        self._stacks[name].close()

    def close(self) -> None:
        for stack in self._stacks.values():
            stack.close()

    def __enter__(self) -> "ServerPool":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _start(self, name: str) -> None:
        try:
            self._started[name] = self._stacks[name].enter_context(self._factories[name]())
        except BaseException as exc:  # noqa: BLE001 - kept and raised by `endpoint` on the main thread
            self._started[name] = exc


def stop_process(proc: subprocess.Popen, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM, then SIGKILL if it is still there after `timeout_s`."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout_s)


def log_tail(text: str, max_lines: int = 3) -> str:
    """Why a log says a server failed, in one line: its last error line, else its last lines."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if _ERROR_LINE.search(line)]
    return (errors[-1] if errors else " | ".join(lines[-max_lines:]))[-1000:]


def process_tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by process `pid` and its living descendants."""
    def cpu_s(process) -> float:
        times = process.cpu_times()
        return times.user + times.system
    return _sum_over_tree(pid, cpu_s)


def process_tree_rss_mb(pid: int) -> float:
    """Resident memory of process `pid` and its living descendants, in MB (2**20 bytes)."""
    return _sum_over_tree(pid, lambda process: process.memory_info().rss) / 2**20


def _sum_over_tree(pid: int, read: Callable[[Any], float]) -> float:
    """`read(process)` summed over process `pid` and its living descendants (one gone meanwhile counts 0: a
    server's helper processes come and go)."""
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for process in [root, *root.children(recursive=True)]:
        try:
            total += read(process)
        except psutil.NoSuchProcess:
            continue
    return total


# ---------------------------------------------------------------- statistics

def percentile(values: list[float], share: float) -> float | None:
    """Linear-interpolated percentile (share in 0..1) of `values`; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    position = share * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def median(values: list[float]) -> float | None:
    return percentile(values, 0.5)


def rounded(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def fmt(value: Any, digits: int = 1) -> str:
    """A table cell: numbers with `digits` decimals, None as n/a."""
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)
