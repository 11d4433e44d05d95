"""uvicorn's own answer to bytes that are not HTTP (a broken request line, headers over h11's size limit), in
the worker's JSON error shape instead of uvicorn's plain text, so every error a client can get is
`{"error": {...}}`."""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from inference_worker.errors import ProtocolError


class JsonErrorH11Protocol(H11Protocol):
    def send_400_response(self, msg: str) -> None:
        error = ProtocolError(f"The request is not valid HTTP/1.1 ({msg.rstrip('.')}); send a request line, "
                              "headers under 16 KiB and a Content-Length.", code="http_error")
        payload = json.dumps(error.to_body()).encode("utf-8")
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=payload),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()
