"""Idle connections: a deadline for each request head and a cap per client address.

uvicorn keeps a connection open for as long as its client likes until a whole request head (request line and
headers) has arrived, and its own connection limit (`limit_concurrency`) counts such connections like any
other: about 140 that never finished their headers left every other client, the app with its key included,
with uvicorn's plain 503 for as long as they stayed open. So the worker leaves that limit off and guards the
*idle* connections itself -- open with no request in progress: just opened, between keep-alive requests, or
still sending a request head. A connection whose head has arrived belongs to the gates (app.py), which cap the
requests in flight.

- A request head must be complete within `header_timeout_s` of the connection opening (or of its first byte on
  a kept-alive connection), however slowly it trickles in. Otherwise the client gets 408 in the worker's JSON
  shape and the connection is closed; one that sent nothing is just closed, as uvicorn closes an idle
  keep-alive connection.
- One client address keeps at most `max_per_client` idle connections; all addresses together IDLE_TOTAL_FACTOR
  times that (any 127.x.y.z is a loopback address a local process can connect from). One more closes the idle
  connection that has waited longest, never the newcomer: a real client's head follows its connect within a
  millisecond, so a pile of stalled connections cannot keep it out. The closed one gets 503 if it had begun a
  head; a pooled keep-alive connection is just closed, and its client opens another.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Any

import h11

from inference_worker.errors import ProtocolError
from inference_worker.server.h11_errors import JsonErrorH11Protocol

log = logging.getLogger("inference_worker")

IDLE_TOTAL_FACTOR = 4           # idle connections of all clients together, in multiples of the per-client cap
MAX_UNREAD_READS = 8            # 64 KiB reads of bytes the loop has not taken yet, before closing a connection


class IdleConnections:
    """The idle connections of one server, oldest first, overall and per client address. Used only on the
    server's event loop."""

    def __init__(self, header_timeout_s: float, max_per_client: int):
        self.header_timeout_s = header_timeout_s
        self.max_per_client = max_per_client
        self.max_total = max_per_client * IDLE_TOTAL_FACTOR
        self._all: dict[GuardedH11Protocol, None] = {}                 # insertion order = oldest first
        self._by_client: dict[str, dict[GuardedH11Protocol, None]] = {}

    def __len__(self) -> int:
        return len(self._all)

    def add(self, connection: GuardedH11Protocol) -> None:
        """`connection` has become idle (no-op if it already was); the longest waiting gives way over a cap."""
        if connection in self._all:
            return
        self._all[connection] = None
        mine = self._by_client.setdefault(connection.client_address, {})
        mine[connection] = None
        if len(mine) > self.max_per_client:
            self._evict(next(iter(mine)), f"{self.max_per_client} connections from this client's address")
        elif len(self._all) > self.max_total:
            self._evict(next(iter(self._all)), f"{self.max_total} connections from all clients")

    def discard(self, connection: GuardedH11Protocol) -> None:
        if connection not in self._all:
            return
        del self._all[connection]
        mine = self._by_client[connection.client_address]
        del mine[connection]
        if not mine:
            del self._by_client[connection.client_address]

    def _evict(self, connection: GuardedH11Protocol, cap: str) -> None:
        self.discard(connection)
        log.debug("closing an idle connection from %s: more than %s were open", connection.client_address, cap)
        connection.give_way(ProtocolError(
            f"Closed: more than {cap} were open without a complete request (--max-idle-connections "
            f"{self.max_per_client}); this one had waited longest. Send each request head whole at once.",
            status=503, code="too_many_connections", headers={"Retry-After": "1"}))


class GuardedH11Protocol(JsonErrorH11Protocol):
    """uvicorn's h11 protocol with the idle-connection guard: a connection is idle while neither side is in a
    request (h11's states are both IDLE); the head deadline runs from the connection's start or, on a kept-alive
    connection, from the next head's first byte (before that, uvicorn's keep-alive timeout applies)."""

    def __init__(self, *args: Any, idle: IdleConnections, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.idle = idle
        self._head_deadline: asyncio.TimerHandle | None = None

    @property
    def client_address(self) -> str:
        return self.client[0] if self.client else ""

    # ------------------------------------------------------------ uvicorn's protocol callbacks

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_head_deadline()
        self._track_idle()

    def data_received(self, data: bytes) -> None:
        if self._head_deadline is None and self._is_idle():
            self._start_head_deadline()          # the first byte of the next request on a kept-alive connection
        super().data_received(data)
        self._track_idle()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self.idle.discard(self)
        self._cancel_head_deadline()
        super().connection_lost(exc)

    # ------------------------------------------------------------ the guard

    def give_way(self, error: ProtocolError) -> None:
        """Close this idle connection: with `error` when part of a request head has arrived, else quietly."""
        self._cancel_head_deadline()
        if self.transport.is_closing():
            return
        unread = self._take_unread_bytes()
        if self.conn.trailing_data[0] or unread:
            self.send_error_and_close(error)
        else:
            self.conn.send(h11.ConnectionClosed())
            self.transport.close()

    def _take_unread_bytes(self) -> bytes:
        """Bytes the kernel holds for this connection that the loop has not read yet, read now. A busy loop accepts
        connections in a burst and may close one before its first read; closing a socket with unread bytes sends
        a reset instead of a close, and the client's kernel then throws our 503 away."""
        sock = self.transport.get_extra_info("socket")
        if sock is None:
            return b""
        unread = b""
        with socket.socket(fileno=os.dup(sock.fileno())) as dup:
            for _ in range(MAX_UNREAD_READS):
                try:
                    chunk = dup.recv(65536, socket.MSG_DONTWAIT)
                except OSError:                  # nothing more waiting (BlockingIOError), or the peer is gone
                    break
                if not chunk:
                    break
                unread += chunk
        return unread

    def _is_idle(self) -> bool:
        return (self.conn.our_state is h11.IDLE and self.conn.their_state is h11.IDLE
                and not self.transport.is_closing())

    def _track_idle(self) -> None:
        if self._is_idle():
            self.idle.add(self)
        else:                                    # its head arrived (the gates take over), or it is closing
            self.idle.discard(self)
            self._cancel_head_deadline()

    def _start_head_deadline(self) -> None:
        self._head_deadline = self.loop.call_later(self.idle.header_timeout_s, self._head_timed_out)

    def _cancel_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if not self._is_idle():
            return
        self.idle.discard(self)
        timeout_s = self.idle.header_timeout_s
        self.give_way(ProtocolError(
            f"The request head (request line and headers) did not arrive within {timeout_s:g} s "
            f"(--header-timeout-s {timeout_s:g}); send it whole at once.", status=408,
            code="request_timeout"))
