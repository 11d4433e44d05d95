"""The worker's lifetime: bind, publish the state file, load the engine on the model thread, serve until
told to stop, then stop the server, the model thread and the engine, and remove the state file.

Binding comes first so GET /health can report loading progress (and the state file can name the URL)
while a large model loads.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import threading
from typing import Callable

from inference_worker.server.auth import default_state_file, new_api_key, remove_state_file, write_state_file
from inference_worker.config import WorkerConfig
from inference_worker.metrics import WorkerMetrics
from inference_worker.server.routes import Routes
from inference_worker.server.app import WorkerHTTPServer
from inference_worker.serving.service import ModelService

log = logging.getLogger("deskeye.worker")

WAIT_INTERVAL_S = 0.2
SHUTDOWN_TIMEOUT_S = 10.0


class WorkerStartError(RuntimeError):
    """The worker could not start or its engine could not load; the message is for the user."""


def run_worker(config: WorkerConfig, stop: threading.Event, load: Callable | None = None) -> None:
    """Serve until `stop` is set. Raises WorkerStartError when it cannot bind or load."""
    if load is None:
        from inference_worker.engines import load_engine as load
    api_key = config.api_key or new_api_key()
    state_path = config.state_file or default_state_file()
    metrics = WorkerMetrics()
    service = ModelService(lambda progress: _frozen(load(config, progress)), config, metrics=metrics,
                           on_ready=lambda engine: publish(engine.kind, engine.model_name))
    server = _bind(config, Routes(config, service, metrics), api_key)

    def publish(engine_kind: str, model: str) -> None:
        write_state_file(state_path, {"url": server.url, "api_key": api_key, "pid": os.getpid(),
                                      "model": model, "engine": engine_kind})

    serving = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": WAIT_INTERVAL_S},
                               name="deskeye-http", daemon=True)
    try:
        publish(config.engine, config.model)
        serving.start()
        service.start()
        log.info("listening on %s (state file %s); loading the engine", server.url, state_path)
        _wait(stop, service)
    finally:
        if serving.is_alive():
            server.shutdown()
        server.server_close()
        service.stop(SHUTDOWN_TIMEOUT_S)
        remove_state_file(state_path)
    if service.state == "failed":
        raise WorkerStartError(f"could not load the engine: {service.load_error}")


def _frozen(engine):
    """The loaded engine, with every object made so far moved out of the garbage collector's reach: the GC then
    never rescans the model's objects (hundreds of thousands with torch + transformers), so pauses while serving
    and the exit are short. A worker-process decision: the service itself leaves the GC alone."""
    gc.collect()
    gc.freeze()
    return engine


def _bind(config: WorkerConfig, routes: Routes, api_key: str) -> WorkerHTTPServer:
    try:
        return WorkerHTTPServer(config.host, config.port, routes, api_key, config.max_body_bytes)
    except OSError as exc:
        hint = ("choose another --port (0 = any free port)" if exc.errno == errno.EADDRINUSE
                else "check --host and --port")
        raise WorkerStartError(f"cannot listen on {config.host}:{config.port}: "
                               f"{exc.strerror or exc}; {hint}.") from None


def _wait(stop: threading.Event, service: ModelService) -> None:
    while not stop.wait(WAIT_INTERVAL_S):
        if service.state == "failed":
            return
