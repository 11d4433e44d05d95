"""How one worker process is launched: its command line from the [worker] settings, and its tie to the app.

The worker runs as `python -m inference_worker.cli` on a port the OS chooses, writing its URL, key and limits to
`state_file` once it listens (deskeye/worker/endpoint.py reads them). On Linux it is asked to die with the thread
that launched it, so a killed app leaves no worker holding a model in memory.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Callable

from deskeye.settings import Settings

PR_SET_PDEATHSIG = 1


def worker_command(settings: Settings, state_file: Path) -> list[str]:
    worker = settings.worker
    command = [sys.executable, "-m", "inference_worker.cli", "--engine", worker.engine, "--port", "0",
               "--state-file", str(state_file), "--device", worker.device, "--dtype", worker.dtype,
               "--decode-weights", worker.decode_weights,
               "--request-timeout-s", str(worker.request_timeout_s)]
    if worker.model:
        command += ["--model", worker.model]
    if worker.ground_with_ocr:
        command.append("--ground-with-ocr")
    return command


def die_with_parent_thread() -> Callable[[], None] | None:
    """On Linux: a preexec_fn asking the kernel to SIGTERM the worker when the thread that launched it (the
    monitor) ends, e.g. when the app is killed, so no orphaned worker keeps a model in memory."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl    # resolved here, before fork
    except (OSError, AttributeError):
        return None
    parent_pid = os.getpid()

    def set_parent_death_signal() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent_pid:                       # the app died before prctl took effect
            os._exit(1)
    return set_parent_death_signal
