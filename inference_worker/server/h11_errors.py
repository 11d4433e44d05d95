"""uvicorn's own answer to bytes that are not HTTP (a broken request line, headers over h11's size limit), in
the worker's JSON error shape instead of uvicorn's plain text, so every error a client can get is
`{"error": {...}}`. The connection guard (connections.py) answers through the same `send_error_and_close`."""

from __future__ import annotations

import http
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from inference_worker.errors import ProtocolError


class JsonErrorH11Protocol(H11Protocol):
    def send_400_response(self, msg: str) -> None:
        self.send_error_and_close(ProtocolError(
            f"The request is not valid HTTP/1.1 ({msg.rstrip('.')}); send a request line, headers under 16 KiB "
            "and a Content-Length.", code="http_error"))

    def send_error_and_close(self, error: ProtocolError) -> None:
        """Answer `error` before (or instead of) any request, then close: h11 lets a server send a response while
        no request head has been read, as it does for a 400 or a 408."""
        payload = json.dumps(error.to_body()).encode("utf-8")
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                   (b"connection", b"close"), *((name.lower().encode("latin-1"), value.encode("latin-1"))
                                                 for name, value in error.headers.items())]
        reason = http.HTTPStatus(error.status).phrase.encode("ascii")
        for event in (h11.Response(status_code=error.status, headers=headers, reason=reason),
                      h11.Data(data=payload), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()
