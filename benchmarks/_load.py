"""The load a benchmark puts on a server under test: requests over keep-alive HTTP connections (`Client`), from
closed-loop clients (`run_closed_loop`: each sends its next request when its answer arrives), timed from a start
they share (`run_together`), and the server's own counters (`fetch_metrics`).
"""

from __future__ import annotations

import http.client
import json
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from benchmarks._harness import Endpoint

REQUEST_TIMEOUT_S = 300.0


@dataclass
class Reply:
    index: int                       # position of the request in the list sent
    status: int                      # HTTP status; 0 = no answer (connection error)
    wall_ms: float                   # client side: request written -> answer read
    body: dict = field(default_factory=dict)
    error: str = ""

    @property
    def is_ok(self) -> bool:
        return self.status == 200 and "choices" in self.body

    @property
    def completion_tokens(self) -> int:
        return int(self.body.get("usage", {}).get("completion_tokens", 0))

    @property
    def content(self) -> str:
        return (self.body["choices"][0]["message"].get("content") or "") if self.is_ok else ""

    @property
    def deskeye(self) -> dict:
        return self.body.get("deskeye", {}) if self.is_ok else {}

    def timing_ms(self, name: str) -> float | None:
        value = self.deskeye.get("timing", {}).get(name)
        return float(value) if isinstance(value, (int, float)) else None


class Client:
    """One keep-alive HTTP connection to an endpoint (reconnects once if the server closed it)."""

    def __init__(self, endpoint: Endpoint, timeout_s: float = REQUEST_TIMEOUT_S):
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._conn: http.client.HTTPConnection | None = None

    def post(self, body: bytes, index: int = 0) -> Reply:
        started = time.perf_counter()
        try:
            status, text = self._post_retrying_once(body)
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            return Reply(index, 0, _ms_since(started), error=f"{type(exc).__name__}: {exc}")
        wall_ms = _ms_since(started)
        try:
            decoded = json.loads(text)
        except ValueError:
            return Reply(index, status, wall_ms, error=text[:500])
        error = "" if status == 200 else json.dumps(decoded)[:500]
        return Reply(index, status, wall_ms, decoded if isinstance(decoded, dict) else {}, error)

    def _post_retrying_once(self, body: bytes) -> tuple[int, str]:
        try:
            return self._post(body)
        except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
            self.close()
            return self._post(body)

    def _post(self, body: bytes) -> tuple[int, str]:
        if self._conn is None:
            self._conn = http.client.HTTPConnection(self.endpoint.host, self.endpoint.port, timeout=self.timeout_s)
        self._conn.request("POST", "/v1/chat/completions", body=body, headers=self.endpoint.headers())
        response = self._conn.getresponse()
        text = response.read().decode("utf-8", errors="replace")
        if response.getheader("Connection", "").lower() == "close":
            self.close()
        return response.status, text

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _ms_since(started: float) -> float:
    return (time.perf_counter() - started) * 1000


def fetch_metrics(endpoint: Endpoint) -> dict[str, float] | None:
    """The server's GET /metrics as {series: value} (the deskeye worker's), or None where it has none."""
    from inference_worker.metrics import parse_metrics

    conn = http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=REQUEST_TIMEOUT_S)
    try:
        conn.request("GET", "/metrics", headers=endpoint.headers())
        response = conn.getresponse()
        text = response.read().decode("utf-8", errors="replace")
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()
    return parse_metrics(text) if response.status == 200 else None


def post_one(endpoint: Endpoint, body: dict) -> Reply:
    client = Client(endpoint)
    try:
        return client.post(json.dumps(body).encode())
    finally:
        client.close()


def run_closed_loop(endpoint: Endpoint, bodies: list[bytes], num_clients: int) -> tuple[list[Reply], float]:
    """`num_clients` threads, each sending its next request when its previous answer arrives, until all
    `bodies` are sent. Returns the replies in request order and the wall time (first send -> last answer)."""
    pending: queue.SimpleQueue[tuple[int, bytes]] = queue.SimpleQueue()
    for item in enumerate(bodies):
        pending.put(item)
    replies: list[Reply] = []

    def client_loop(_client_index: int, ready: Callable[[], None]) -> None:
        client = Client(endpoint)
        try:
            ready()
            while True:
                try:
                    index, body = pending.get_nowait()
                except queue.Empty:
                    return
                replies.append(client.post(body, index))      # list.append is atomic
        finally:
            client.close()

    wall_s = run_together(client_loop, num_clients, name="bench-client")
    return sorted(replies, key=lambda r: r.index), wall_s


def run_together(work: Callable[[int, Callable[[], None]], None], num_threads: int, *, name: str) -> float:
    """Run `work(i, ready)` for i in range(num_threads), each on a thread of its own, and return the wall seconds
    from their common start to the last one's end. Each calls `ready()` once set up (its client made) and waits
    there until all are: the clock starts when every client can send, so no set-up is timed and none starts
    ahead of the others."""
    start = threading.Barrier(num_threads + 1)
    threads = [threading.Thread(target=work, args=(i, start.wait), name=f"{name}-{i}", daemon=True)
               for i in range(num_threads)]
    for thread in threads:
        thread.start()
    start.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started
