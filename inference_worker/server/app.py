"""The worker's HTTP transport: an OpenAI-compatible FastAPI app served by uvicorn on the loopback interface.

Every request passes the same gates (`Gates`, one ASGI middleware) before a route sees it: the Host header must
name this worker (421, DNS-rebinding guard), a bearer key is required everywhere except GET /health (401), at
most --max-connections requests are served at once (503 + Retry-After; probes are exempt), and a POST body
needs a Content-Length under the cap (411, 413) and must arrive within --body-timeout-s (408). The body is read
here, once, and handed to the route as bytes. Every error is `{"error": {...}}` (errors.py) and the server keeps
serving. Routes live in routes.py; the OpenAPI description is at /openapi.json.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from inference_worker.errors import ProtocolError, TooManyConnectionsError
from inference_worker.server.auth import is_authorized
from inference_worker.server.routes import AUTHORIZED_KEY, BODY_KEY, register_routes

log = logging.getLogger("inference_worker")

KNOWN_ROUTES = ("/v1/chat/completions", "/v1/models", "/health", "/metrics", "/openapi.json")
UNGATED_ROUTES = ("/health",)      # no key needed: the supervisor's probe
PROBE_ROUTES = ("/health", "/metrics")   # never refused for being busy
KNOWN_METHODS = ("GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
DEFAULT_RETRY_AFTER_S = "1"

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


@dataclass(frozen=True)
class GateSettings:
    """What the gates check, fixed once the socket is bound."""
    api_key: str
    bound_host: str
    bound_port: int
    max_body_bytes: int
    body_timeout_s: float
    max_connections: int

    @property
    def url(self) -> str:
        return worker_url(self.bound_host, self.bound_port)

    @property
    def allowed_hosts(self) -> set[str]:
        return allowed_host_headers(self.bound_host, self.bound_port)


def worker_url(host: str, port: int) -> str:
    host = "127.0.0.1" if host in WILDCARD_HOSTS else host
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def allowed_host_headers(host: str, port: int) -> set[str]:
    """Host header values naming this worker: its address or a loopback name, with its port."""
    names = {host.lower(), "localhost", "127.0.0.1", "[::1]"}
    if ":" in host:
        names.add(f"[{host.lower()}]")
    with_port = {f"{name}:{port}" for name in names}
    return with_port | (names if port == 80 else set())


def is_allowed_host(header: str | None, settings: GateSettings) -> bool:
    if not header:
        return False
    value = header.strip().lower().rstrip(".")
    if value in settings.allowed_hosts:
        return True
    if settings.bound_host in WILDCARD_HOSTS:   # listening everywhere on purpose: accept IP literals, not names
        name, _, port = value.rpartition(":")
        try:
            ipaddress.ip_address(name.strip("[]"))
        except ValueError:
            return False
        return port == str(settings.bound_port)
    return False


def build_app(routes, settings: GateSettings) -> FastAPI:
    """The worker's ASGI app: FastAPI routes (routes.py) behind the gates, errors in the worker's shape."""

    app = FastAPI(title="deskeye-worker", version="1", docs_url=None, redoc_url=None,
                  description="DeskEye's inference worker: OpenAI-compatible chat completions over a local model. "
                              "Every route except GET /health needs 'Authorization: Bearer <key>'.")
    register_routes(app, routes)
    app.add_exception_handler(ProtocolError, _protocol_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _unexpected_error)
    return Gates(app, settings, routes.metrics)


# ---------------------------------------------------------------- the gates (ASGI middleware)

class Gates:
    """Host, method, key, connection cap and body, in that order; counts every answer in /metrics."""

    def __init__(self, app: Callable, settings: GateSettings, metrics):
        self.app = app
        self.settings = settings
        self.metrics = metrics
        self.num_open = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started_s = time.monotonic()
        route = scope["path"] if scope["path"] in KNOWN_ROUTES else "other"
        status: list[int] = []

        async def counted_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        is_counted = route not in PROBE_ROUTES
        self.num_open += is_counted
        self.metrics.open_requests.set(self.num_open)
        try:
            await self._serve(scope, receive, counted_send)
        finally:
            self.num_open -= is_counted
            self.metrics.open_requests.set(self.num_open)
            code = str(status[0]) if status else "0"
            self.metrics.requests.labels(code=code, route=route).inc()
            if route == "/v1/chat/completions":
                self.metrics.latency.observe(time.monotonic() - started_s)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = _headers(scope)
        try:
            self._check_gates(scope, headers)
            if scope["method"] == "POST":
                scope[BODY_KEY] = await self._read_body(headers, receive)
        except ProtocolError as exc:
            await send_error(send, exc, close=scope["method"] == "POST" and BODY_KEY not in scope)
            return
        await self.app(scope, receive, send)

    def _check_gates(self, scope: Scope, headers: dict[str, str]) -> None:
        settings = self.settings
        if not is_allowed_host(headers.get("host"), settings):
            raise ProtocolError(
                f"Host header {headers.get('host')!r} does not name this worker; it answers only requests "
                f"addressed to {settings.url} or localhost:{settings.bound_port} (DNS-rebinding guard).",
                status=421, param="Host", code="misdirected_request")
        if scope["method"] not in KNOWN_METHODS:
            raise ProtocolError(f"Unsupported method ({scope['method']!r}); this worker answers "
                                f"{', '.join(KNOWN_METHODS)}.", status=501, code="http_error")
        scope[AUTHORIZED_KEY] = is_authorized(headers.get("authorization"), settings.api_key)
        if scope["path"] not in UNGATED_ROUTES and not scope[AUTHORIZED_KEY]:
            given = "a wrong key" if headers.get("authorization") else "no key"
            raise ProtocolError(f"Unauthorized: the request carried {given}. Send 'Authorization: Bearer <key>' "
                                "with the api_key from the worker's state file (or the --api-key it was given).",
                                status=401, param="Authorization", code="invalid_api_key")
        if scope["path"] not in PROBE_ROUTES and self.num_open > settings.max_connections:
            self.metrics.rejected_busy.labels(reason="too_many_connections").inc()
            raise TooManyConnectionsError(settings.max_connections)

    async def _read_body(self, headers: dict[str, str], receive: Receive) -> bytes:
        """The whole body, or ProtocolError: 411 without a length, 413 over the cap (before reading it), 408 when
        it does not arrive within --body-timeout-s, 400 when the client ends it early."""
        if headers.get("transfer-encoding"):
            raise ProtocolError("Chunked request bodies are not accepted; send a Content-Length.", status=411,
                                param="Content-Length", code="length_required")
        length = content_length(headers.get("content-length"))
        if length > self.settings.max_body_bytes:
            raise ProtocolError(f"The request body is {length:,} bytes; this worker accepts at most "
                                f"{self.settings.max_body_bytes:,} (send a smaller image, or start it with a larger "
                                "--max-body-bytes).", status=413, param="Content-Length", code="body_too_large")
        chunks: list[bytes] = []
        num_read = 0
        deadline_s = time.monotonic() + self.settings.body_timeout_s
        more = length > 0
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline_s - time.monotonic()))
            except asyncio.TimeoutError:
                raise ProtocolError(
                    f"The request body did not arrive within {self.settings.body_timeout_s:g} s (--body-timeout-s): "
                    f"got {num_read:,} of the {length:,} bytes its Content-Length announced.", status=408,
                    param="Content-Length", code="request_timeout") from None
            if message["type"] == "http.disconnect":
                raise ProtocolError(f"The request body ended after {num_read} of {length} bytes.",
                                    param="Content-Length")
            chunks.append(message.get("body", b""))
            num_read += len(chunks[-1])
            more = message.get("more_body", False)
        return b"".join(chunks)


def content_length(header: str | None) -> int:
    if header is None:
        raise ProtocolError("A Content-Length header is required.", status=411, param="Content-Length",
                            code="length_required")
    try:
        length = int(header)
    except ValueError:
        length = -1
    if length < 0:
        raise ProtocolError(f"Content-Length {header!r} is not a byte count.", param="Content-Length")
    return length


def _headers(scope: Scope) -> dict[str, str]:
    return {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}


# ---------------------------------------------------------------- errors in the worker's shape

def error_headers(exc: ProtocolError) -> dict[str, str]:
    headers = {"Cache-Control": "no-store", **exc.headers}
    if exc.status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="deskeye-worker"'
    if exc.status == 503:
        headers.setdefault("Retry-After", DEFAULT_RETRY_AFTER_S)
    return headers


async def send_error(send: Send, exc: ProtocolError, *, close: bool = False) -> None:
    """An error answered by the gates themselves (before any route); `close` when the body is still unread."""
    payload = json.dumps(exc.to_body()).encode("utf-8")
    headers = {**error_headers(exc), "Content-Type": "application/json", "Content-Length": str(len(payload))}
    if close:
        headers["Connection"] = "close"
    await send({"type": "http.response.start", "status": exc.status,
                "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]})
    await send({"type": "http.response.body", "body": payload})


def error_response(exc: ProtocolError) -> JSONResponse:
    return JSONResponse(exc.to_body(), status_code=exc.status, headers=error_headers(exc))


async def _protocol_error(request: Request, exc: ProtocolError) -> JSONResponse:
    return error_response(exc)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    path = request.url.path
    if exc.status_code == 404:
        error = ProtocolError(f"No route {path}; this worker serves {', '.join(KNOWN_ROUTES)}.", status=404,
                              code="not_found")
    elif exc.status_code == 405:
        error = ProtocolError(f"{request.method} is not allowed on {path}.", status=405, code="method_not_allowed",
                              headers=dict(exc.headers or {}))
    else:
        error = ProtocolError(str(exc.detail), status=exc.status_code, code="http_error")
    return error_response(error)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = (exc.errors() or [{}])[0]
    where = ".".join(str(p) for p in first.get("loc", ()))
    return error_response(ProtocolError(f"{where}: {first.get('msg', 'invalid')}.", param=where or None))


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    log.error("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(ProtocolError(f"Internal error: {type(exc).__name__}", status=500, code="server_error"))
