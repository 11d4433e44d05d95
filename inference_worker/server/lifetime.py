"""The worker's lifetime: bind, publish the state file, load the engine on the model thread, serve until
told to stop, then stop the server, the model thread and the engine, and remove the state file.

Binding comes first so GET /health can report loading progress (and the state file can name the URL)
while a large model loads. The socket is bound here (listen backlog LISTEN_BACKLOG) and handed to uvicorn, which
serves the FastAPI app (app.py) on its own thread with its own event loop.
"""

from __future__ import annotations

import errno
import functools
import gc
import logging
import os
import socket
import threading
from typing import Callable

import uvicorn

from inference_worker.server.auth import default_state_file, new_api_key, remove_state_file, write_state_file
from inference_worker.config import LISTEN_BACKLOG, WorkerConfig
from inference_worker.errors import WorkerStartError
from inference_worker.metrics import WorkerMetrics
from inference_worker.server.app import GateSettings, build_app, worker_url
from inference_worker.server.connections import GuardedH11Protocol, IdleConnections
from inference_worker.server.routes import Routes
from inference_worker.serving.service import ModelService

log = logging.getLogger("deskeye.worker")

WAIT_INTERVAL_S = 0.2
SHUTDOWN_TIMEOUT_S = 10.0
KEEP_ALIVE_S = 5.0


def run_worker(config: WorkerConfig, stop: threading.Event, load: Callable | None = None) -> None:
    """Serve until `stop` is set. Raises WorkerStartError when it cannot bind or load."""
    if load is None:
        from inference_worker.engines import load_engine as load
    api_key = config.api_key or new_api_key()
    state_path = config.state_file or default_state_file()
    metrics = WorkerMetrics()
    service = ModelService(lambda progress: _frozen(load(config, progress)), config, metrics=metrics,
                           on_ready=lambda engine: publish(engine.kind, engine.model_name))
    sock = _bind(config)
    port = sock.getsockname()[1]
    url = worker_url(config.host, port)
    settings = GateSettings(api_key=api_key, bound_host=config.host, bound_port=port,
                            max_body_bytes=config.max_body_bytes, body_timeout_s=config.body_timeout_s,
                            max_connections=config.max_connections)
    server = uvicorn.Server(_uvicorn_config(build_app(Routes(config, service, metrics), settings), config))

    def publish(engine_kind: str, model: str) -> None:
        write_state_file(state_path, {"url": url, "api_key": api_key, "pid": os.getpid(),
                                      "model": model, "engine": engine_kind})

    serving = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="deskeye-http", daemon=True)
    try:
        publish(config.engine, config.model)
        serving.start()
        service.start()
        log.info("listening on %s (state file %s); loading the engine", url, state_path)
        _wait(stop, service, serving)
    finally:
        server.should_exit = True
        if serving.is_alive():
            serving.join(SHUTDOWN_TIMEOUT_S)
        sock.close()
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


def _bind(config: WorkerConfig) -> socket.socket:
    """A listening socket with a real backlog (http.server's was 5), bound before anything loads. It is made as
    IPPROTO_TCP, so asyncio sets TCP_NODELAY on every connection it accepts (it checks the protocol number; a
    socket made with proto 0 kept Nagle on, and each answer after a connection's first then waited ~40 ms for
    the client's delayed ACK); TCP_NODELAY is also set here, which Linux passes on to accepted sockets."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((config.host, config.port))
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        hint = ("choose another --port (0 = any free port)" if exc.errno == errno.EADDRINUSE
                else "check --host and --port")
        raise WorkerStartError(f"cannot listen on {config.host}:{config.port}: "
                               f"{exc.strerror or exc}; {hint}.") from None
    sock.set_inheritable(True)
    return sock


def _uvicorn_config(app, config: WorkerConfig) -> uvicorn.Config:
    """uvicorn serves h11 with the idle-connection guard (connections.py: a request-head deadline, a cap per
    client address); its own connection cap (limit_concurrency) stays off, because it counts connections that
    never finish their headers and then answers every client, the one with the key too, with a plain 503.
    Requests in flight are capped by the gates (app.py). No WebSocket upgrades (the worker serves none); the
    access log stays off (the worker counts requests itself)."""
    idle = IdleConnections(config.header_timeout_s, config.max_idle_connections)
    return uvicorn.Config(app, http=functools.partial(GuardedH11Protocol, idle=idle), ws="none", lifespan="off",
                          access_log=False, log_config=None, backlog=LISTEN_BACKLOG, timeout_keep_alive=KEEP_ALIVE_S,
                          timeout_graceful_shutdown=SHUTDOWN_TIMEOUT_S / 2, server_header=False,
                          date_header=False)


def _wait(stop: threading.Event, service: ModelService, serving: threading.Thread) -> None:
    while not stop.wait(WAIT_INTERVAL_S):
        if service.state == "failed":
            return
        if not serving.is_alive():
            raise WorkerStartError("the HTTP server stopped unexpectedly; see the log above.")
