"""The worker's HTTP transport: an OpenAI-compatible server on the loopback interface.

Every request passes the same gates before a route sees it: the Host header must name this worker
(DNS-rebinding guard), a bearer key is required everywhere except GET /health, a POST body needs a
Content-Length under the cap and must be a JSON object. Every error is `{"error": {...}}` (ProtocolError
shape) and the server keeps serving. Routes live in routes.py.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import socket
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from inference_worker.server.auth import is_authorized
from inference_worker.protocol import ProtocolError
from inference_worker.server.routes import Routes

log = logging.getLogger("deskeye.worker")

SOCKET_TIMEOUT_S = 60.0        # a client that stalls mid-request is dropped after this long
KNOWN_ROUTES = ("/v1/chat/completions", "/v1/models", "/health", "/metrics")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


class WorkerHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, port: int, routes: Routes, api_key: str, max_body_bytes: int):
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), WorkerRequestHandler)
        self.routes = routes
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.bound_host = host
        self.bound_port = self.server_address[1]
        self.allowed_hosts = allowed_host_headers(host, self.bound_port)

    def handle_error(self, request, client_address) -> None:
        """A client that hangs up mid-request is routine: one debug line, not a traceback on stderr."""
        import sys
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            log.debug("client %s: %s", client_address[0], exc)
        else:
            log.warning("error while serving %s", client_address[0], exc_info=True)

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.bound_host in WILDCARD_HOSTS else self.bound_host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.bound_port}"


def allowed_host_headers(host: str, port: int) -> set[str]:
    """Host header values naming this worker: its address or a loopback name, with its port."""
    names = {host.lower(), "localhost", "127.0.0.1", "[::1]"}
    if ":" in host:
        names.add(f"[{host.lower()}]")
    with_port = {f"{name}:{port}" for name in names}
    return with_port | (names if port == 80 else set())


def is_allowed_host(header: str | None, server: WorkerHTTPServer) -> bool:
    if not header:
        return False
    value = header.strip().lower().rstrip(".")
    if value in server.allowed_hosts:
        return True
    if server.bound_host in WILDCARD_HOSTS:   # listening everywhere on purpose: accept IP literals, not names
        name, _, port = value.rpartition(":")
        try:
            ipaddress.ip_address(name.strip("[]"))
        except ValueError:
            return False
        return port == str(server.bound_port)
    return False


class WorkerRequestHandler(BaseHTTPRequestHandler):
    server: WorkerHTTPServer
    protocol_version = "HTTP/1.1"
    #: TCP_NODELAY: headers and body go out in two writes; with Nagle on, a keep-alive client's delayed ACK
    #: held every body back ~40 ms (measured with benchmarks/throughput.py)
    disable_nagle_algorithm = True
    timeout = SOCKET_TIMEOUT_S
    server_version = "deskeye-worker"

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._handle("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._handle("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._handle("PUT")

    def do_DELETE(self) -> None:  # noqa: N802
        self._handle("DELETE")

    def _handle(self, method: str) -> None:
        started_s = time.monotonic()
        self._body_read = False
        route = self.path.split("?", 1)[0]
        try:
            self._check_gates(route)
            status, body = self._dispatch(method, route)
        except ProtocolError as exc:
            status, body = exc.status, exc.to_body()
        except Exception as exc:  # noqa: BLE001 - the server answers and keeps serving
            log.exception("unexpected error on %s %s", method, route)
            status, body = 500, ProtocolError(f"Internal error: {type(exc).__name__}", status=500,
                                              code="server_error").to_body()
        self._respond(status, body)
        label = route if route in KNOWN_ROUTES else "other"
        self.server.routes.metrics.requests.inc(route=label, code=str(status))
        if route == "/v1/chat/completions":
            self.server.routes.metrics.latency.observe(time.monotonic() - started_s)

    def _check_gates(self, route: str) -> None:
        if not is_allowed_host(self.headers.get("Host"), self.server):
            raise ProtocolError(
                f"Host header {self.headers.get('Host')!r} does not name this worker; it answers only requests "
                f"addressed to {self.server.url} or localhost:{self.server.bound_port} (DNS-rebinding guard).",
                status=421, param="Host", code="misdirected_request")
        if route != "/health" and not is_authorized(self.headers.get("Authorization"), self.server.api_key):
            given = "a wrong key" if self.headers.get("Authorization") else "no key"
            raise ProtocolError(f"Unauthorized: the request carried {given}. Send 'Authorization: Bearer <key>' "
                                "with the api_key from the worker's state file (or the --api-key it was given).",
                                status=401, param="Authorization", code="invalid_api_key")

    def _dispatch(self, method: str, route: str) -> tuple[int, Any]:
        routes = self.server.routes
        table = {
            ("POST", "/v1/chat/completions"): lambda: routes.chat_completions(self._read_json()),
            ("GET", "/v1/models"): routes.models,
            ("GET", "/health"): routes.health,
            ("GET", "/metrics"): routes.metrics_text,
        }
        handler = table.get((method, route))
        if handler is not None:
            return handler()
        if route in KNOWN_ROUTES:
            raise ProtocolError(f"{method} is not allowed on {route}.", status=405, code="method_not_allowed")
        raise ProtocolError(f"No route {route}; this worker serves {', '.join(KNOWN_ROUTES)}.", status=404,
                            code="not_found")

    def _read_json(self) -> Any:
        if self.headers.get("Transfer-Encoding"):
            raise ProtocolError("Chunked request bodies are not accepted; send a Content-Length.", status=411,
                                param="Content-Length", code="length_required")
        length = _content_length(self.headers.get("Content-Length"))
        if length > self.server.max_body_bytes:
            raise ProtocolError(f"The request body is {length:,} bytes; this worker accepts at most "
                                f"{self.server.max_body_bytes:,} (send a smaller image, or start it with a larger "
                                "--max-body-bytes).", status=413, param="Content-Length", code="body_too_large")
        raw = self.rfile.read(length)
        self._body_read = True
        if len(raw) != length:
            raise ProtocolError(f"The request body ended after {len(raw)} of {length} bytes.",
                                param="Content-Length")
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, ValueError) as exc:
            raise ProtocolError(f"The request body is not valid JSON ({_json_reason(exc)}).",
                                code="invalid_json") from None

    def _respond(self, status: int, body: Any) -> None:
        if isinstance(body, str):
            payload, content_type = body.encode("utf-8"), "text/plain; version=0.0.4; charset=utf-8"
        else:
            payload, content_type = json.dumps(body).encode("utf-8"), "application/json"
        has_body = self.headers.get("Content-Length", "0") != "0" or bool(self.headers.get("Transfer-Encoding"))
        unread_body = has_body and not self._body_read
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("Cache-Control", "no-store")
        if status == 401:
            self.send_header("WWW-Authenticate", 'Bearer realm="deskeye-worker"')
        if status == 503:
            self.send_header("Retry-After", "1")
        if unread_body:          # the client's body is still on the socket: this connection cannot be reused
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(payload)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own errors (unsupported method, malformed request line, huge headers) as JSON too."""
        text = message or HTTPStatus(code).phrase
        payload = json.dumps(ProtocolError(text, status=code, code="http_error").to_body()).encode("utf-8")
        self.close_connection = True
        self.send_response(code, message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD" and code >= 200 and code not in (HTTPStatus.NO_CONTENT, HTTPStatus.NOT_MODIFIED):
            self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        log.debug("%s %s", self.address_string(), format % args)


def _content_length(header: str | None) -> int:
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


def _json_reason(exc: Exception) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"{exc.msg} at line {exc.lineno} column {exc.colno}"
    return "it is not UTF-8 text"
