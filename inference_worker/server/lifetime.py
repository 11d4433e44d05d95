"""The worker's lifetime: bind, publish the state file, load the engine on the model thread, serve until
told to stop, then stop the server, the model thread and the engine, and remove the state file.

Binding comes first so GET /health can report loading progress (and the state file can name the URL)
while a large model loads. The socket is bound here (listen backlog LISTEN_BACKLOG) and handed to uvicorn, which
serves the FastAPI app (app.py) on its own thread with its own event loop.

An idle worker sleeps: the main thread waits on `stop` alone (set by a signal, or by the worker itself when the
engine fails to load or the HTTP server ends on its own), the HTTP thread's event loop has no timer of its own
(`QuietServer`), and the model thread waits on its queue (scheduler.py). Polling them every 0.1-0.2 s would cost
25 wakeups a second, about a third of a percent of a core, on a desktop where nothing happens.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from inference_worker.engines.base import Engine
from inference_worker.errors import WorkerStartError
from inference_worker.metrics import WorkerMetrics
from inference_worker.server.app import GateSettings, build_app, worker_url
from inference_worker.server.connections import GuardedH11Protocol, IdleConnections
from inference_worker.server.routes import Routes
from inference_worker.serving.service import ModelService

log = logging.getLogger("inference_worker")

SHUTDOWN_TIMEOUT_S = 10.0
KEEP_ALIVE_S = 5.0


def run_worker(config: WorkerConfig, stop: threading.Event, load: Callable | None = None) -> None:
    """Serve until `stop` is set. Raises WorkerStartError when it cannot bind or load, or when the HTTP server
    ends on its own; `stop` is then set too (it is what the main thread sleeps on)."""
    if load is None:
        from inference_worker.engines import load_engine as load
    api_key = config.api_key or new_api_key()
    state_path = config.state_file or default_state_file()
    metrics = WorkerMetrics()
    service = ModelService(lambda progress: _frozen(load(config, progress)), config, metrics=metrics,
                           on_ready=lambda engine: publish(engine), on_failed=lambda error: stop.set())
    sock = _bind(config)
    port = sock.getsockname()[1]
    url = worker_url(config.host, port)
    settings = GateSettings(api_key=api_key, bound_host=config.host, bound_port=port,
                            max_body_bytes=config.max_body_bytes, body_timeout_s=config.body_timeout_s,
                            max_connections=config.max_connections)
    server = QuietServer(_uvicorn_config(build_app(Routes(config, service, metrics), settings), config))

    def publish(engine: Engine | None) -> None:
        """Once listening (what the flags ask for), and again once the engine is ready (what it loaded)."""
        kind, model = (config.engine, config.model) if engine is None else (engine.kind, engine.model_name)
        write_state_file(state_path, {"url": url, "api_key": api_key, "pid": os.getpid(), "model": model,
                                      "engine": kind, "limits": published_limits(config, engine)})

    serving = threading.Thread(target=_serve, args=(server, sock, stop), name="deskeye-http", daemon=True)
    try:
        publish(None)
        serving.start()
        service.start()
        log.info("listening on %s (state file %s); loading the engine", url, state_path)
        stop.wait()
        if server.has_ended_early:
            raise WorkerStartError("the HTTP server stopped unexpectedly; see the log above.")
    finally:
        server.request_exit()
        if serving.is_alive():
            serving.join(SHUTDOWN_TIMEOUT_S)
        sock.close()
        service.stop(SHUTDOWN_TIMEOUT_S)
        remove_state_file(state_path)
    if service.state == "failed":
        raise WorkerStartError(f"could not load the engine: {service.load_error}")


def published_limits(config: WorkerConfig, engine: Engine | None = None) -> dict[str, int]:
    """The request limits a client should stay within, for the state file: the app sizes its frames and prompts
    by them instead of keeping its own copies. `max_prompt_tokens` is the loaded engine's effective limit (its
    model's context, or less with --max-prompt-tokens) once known; before that, and for an engine that reads no
    context, the flag's value (0 = the model's context)."""
    bounds = getattr(engine, "bounds", None)          # PromptBounds of the engines that tokenize a prompt
    return {"max_image_pixels": config.max_image_pixels, "max_request_pixels": int(config.max_request_pixels),
            "max_images": config.max_images, "max_tokens_limit": config.max_tokens_limit,
            "max_prompt_tokens": bounds.most_prompt_tokens if bounds is not None else config.max_prompt_tokens,
            "max_body_bytes": config.max_body_bytes}


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


def _serve(server: QuietServer, sock: socket.socket, stop: threading.Event) -> None:
    """The HTTP thread: serve until told to exit; if the server ends without being told, wake the main thread."""
    try:
        server.run(sockets=[sock])
    finally:
        server.has_ended_early = not server.should_exit
        stop.set()


class QuietServer(uvicorn.Server):
    """uvicorn's server without its 10-a-second tick: uvicorn's main loop sleeps 0.1 s at a time to look at
    `should_exit` (and refresh the Date header, which the worker does not send); this one awaits an event that
    `request_exit()` sets from any thread, so an idle worker's event loop sleeps until a connection comes."""

    def __init__(self, config: uvicorn.Config):
        super().__init__(config)
        self.has_ended_early = False
        self._exit_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._exit: asyncio.Event | None = None

    async def main_loop(self) -> None:
        if self.config.date_header or self.config.callback_notify is not None or self.limit_max_requests:
            await super().main_loop()        # those need the tick; the worker sets none of them
            return
        with self._exit_lock:
            self._loop, self._exit = asyncio.get_running_loop(), asyncio.Event()
        if not await self.on_tick(0):        # sets the default headers once; True if told to exit already
            await self._exit.wait()

    def request_exit(self) -> None:
        """Stop serving (then uvicorn's graceful shutdown runs). Any thread; idempotent."""
        with self._exit_lock:
            self.should_exit = True
            if self._loop is not None:
                with contextlib.suppress(RuntimeError):      # the loop is closed: the server has ended
                    self._loop.call_soon_threadsafe(self._exit.set)
