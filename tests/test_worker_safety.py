"""Bad input gets a clear 4xx naming the problem, and the real worker keeps serving the next good request.

Every request here goes over a real socket to the session's worker subprocess (tiny Idefics3 model).
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import stat
import struct
import zlib

import pytest
from PIL import Image

from inference_worker.config import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_TOKENS_LIMIT
from deskeye.prompt import image_data_url

pytestmark = [pytest.mark.subprocess]

CHAT = "/v1/chat/completions"


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_claiming_size(width: int, height: int) -> bytes:
    """A ~60-byte PNG whose header claims width x height pixels (a decompression bomb's shape)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + png_chunk(b"IEND", b""))


def small_png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 24), (20, 120, 220)).save(buf, "PNG")
    return buf.getvalue()


def chat_body(*, model: str = "deskeye", image_url: str | None = None, max_tokens: int = 4,
              num_images: int = 0) -> dict:
    content = [{"type": "text", "text": "What is this?"}]
    urls = ([image_url] if image_url else []) + [image_data_url(small_png())] * num_images
    content += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}


def b64_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


# (id, request kwargs for WorkerHandle.request, expected status, words the message must contain)
BAD_REQUESTS = [
    ("no-key", dict(method="GET", path="/v1/models", auth=False), 401, ["no key", "Authorization: Bearer"]),
    ("wrong-key", dict(method="POST", path=CHAT, body=chat_body(), headers={"Authorization": "Bearer not-the-key"}),
     401, ["wrong key"]),
    ("dns-rebinding-host", dict(method="POST", path=CHAT, body=chat_body(),
                                headers={"Host": "attacker.example:{port}"}), 421, ["Host header", "attacker.example"]),
    ("malformed-json", dict(method="POST", path=CHAT, raw=b'{"model": "deskeye", "messages": [}'), 400,
     ["not valid JSON", "line 1"]),
    ("broken-base64", dict(method="POST", path=CHAT, body=chat_body(image_url="data:image/png;base64,iVBOR%%w0K")),
     400, ["messages[0].content[1]", "base64"]),
    ("not-an-image", dict(method="POST", path=CHAT, body=chat_body(image_url=b64_url(b"%PDF-1.7 not a picture"))),
     400, ["messages[0].content[1]", "not an image"]),
    ("unsupported-mime", dict(method="POST", path=CHAT, body=chat_body(image_url=b64_url(b"x", "image/tiff"))),
     415, ["image/tiff"]),
    ("too-many-pixels", dict(method="POST", path=CHAT,
                             body=chat_body(image_url=b64_url(png_claiming_size(9000, 9000)))),
     413, ["9000x9000", f"{DEFAULT_MAX_IMAGE_PIXELS:,}", "--max-image-pixels"]),
    ("decompression-bomb", dict(method="POST", path=CHAT,
                                body=chat_body(image_url=b64_url(png_claiming_size(10**5, 10**5)))),
     413, ["10,000,000,000 pixels"]),
    ("unknown-model", dict(method="POST", path=CHAT, body=chat_body(model="gpt-17")), 404, ["Unknown model", "gpt-17"]),
    ("max-tokens-over-limit", dict(method="POST", path=CHAT, body=chat_body(max_tokens=DEFAULT_MAX_TOKENS_LIMIT + 1)),
     400, ["max_tokens", str(DEFAULT_MAX_TOKENS_LIMIT)]),
    ("too-many-images", dict(method="POST", path=CHAT, body=chat_body(num_images=5)), 413, ["At most 4 images"]),
    ("no-messages", dict(method="POST", path=CHAT, body={"model": "deskeye", "messages": []}), 400, ["messages"]),
    ("bad-schema", dict(method="POST", path=CHAT, body={**chat_body(), "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}}), 400,
     ["not a valid JSON Schema"]),
    ("several-choices", dict(method="POST", path=CHAT, body={**chat_body(), "n": 2}), 400,
     ["n:", "less than or equal to 1"]),
    # issue 11, Why 5: client input that used to be a 500
    ("deeply-nested-body", dict(method="POST", path=CHAT,
                                raw=b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"), 400, ["nested too deeply"]),
    ("deeply-nested-schema", dict(method="POST", path=CHAT, body=None, raw=(
        b'{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", '
        b'"json_schema": {"name": "x", "schema": ' + b'{"items": ' * 5000 + b"{}" + b"}" * 5000 + b"}}}")),
     400, ["nested too deeply"]),
    ("seed-beyond-64-bits", dict(method="POST", path=CHAT, body={**chat_body(), "seed": 2**70}), 400,
     ["seed", "less than or equal to 9223372036854775807"]),
    ("boolean-max-tokens", dict(method="POST", path=CHAT, body={**chat_body(), "max_tokens": True}), 400,
     ["max_tokens", "valid integer"]),
    ("role-not-known", dict(method="POST", path=CHAT, body={"messages": [{"role": "bot", "content": "hi"}]}), 400,
     ["messages[0].role", "'system', 'user' or 'assistant'", "'bot'"]),
    ("unknown-route", dict(method="GET", path="/v1/embeddings"), 404, ["/v1/embeddings"]),
    ("wrong-method", dict(method="GET", path=CHAT), 405, ["GET"]),
    ("unsupported-method", dict(method="PATCH", path=CHAT), 501, ["Unsupported method"]),
]


def assert_serves_a_good_request(worker) -> None:
    status, body = worker.request("POST", CHAT, chat_body(num_images=1))
    assert status == 200, body
    assert body["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize("kwargs, status, words", [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_gets_a_clear_error_and_the_worker_keeps_serving(tiny_worker, kwargs, status, words):
    kwargs = dict(kwargs)
    headers = {k: v.format(port=tiny_worker.port) for k, v in kwargs.pop("headers", {}).items()}
    got, body = tiny_worker.request(kwargs.pop("method"), kwargs.pop("path"), headers=headers, **kwargs)
    assert got == status, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    for word in words:
        assert word in error["message"], error
    assert_serves_a_good_request(tiny_worker)


def raw_exchange(worker, head: bytes, body: bytes = b"") -> tuple[int, dict]:
    """Send bytes as they are (no client library fixing the headers up) and read one response."""
    conn = http.client.HTTPConnection(worker.host, worker.port, timeout=30)
    conn.connect()
    try:
        conn.sock.sendall(head + body)
        response = http.client.HTTPResponse(conn.sock)
        response.begin()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_body_over_the_size_cap_is_refused_before_it_is_read(tiny_worker):
    too_big = DEFAULT_MAX_BODY_BYTES + 1
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1:{tiny_worker.port}\r\nAuthorization: Bearer "
            f"{tiny_worker.api_key}\r\nContent-Type: application/json\r\nContent-Length: {too_big}\r\n\r\n").encode()
    status, body = raw_exchange(tiny_worker, head, b"{" + b" " * 4096)
    assert status == 413
    assert f"{too_big:,} bytes" in body["error"]["message"] and "--max-body-bytes" in body["error"]["message"]
    assert_serves_a_good_request(tiny_worker)


def test_post_without_content_length_is_refused(tiny_worker):
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: localhost:{tiny_worker.port}\r\nAuthorization: Bearer "
            f"{tiny_worker.api_key}\r\nConnection: close\r\n\r\n").encode()
    status, body = raw_exchange(tiny_worker, head)
    assert status == 411 and "Content-Length" in body["error"]["message"]
    assert_serves_a_good_request(tiny_worker)


def test_chunked_body_is_refused_with_411(tiny_worker):
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: localhost:{tiny_worker.port}\r\nAuthorization: Bearer "
            f"{tiny_worker.api_key}\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n").encode()
    status, body = raw_exchange(tiny_worker, head, b"5\r\nhello\r\n0\r\n\r\n")
    assert status == 411 and "Chunked request bodies are not accepted" in body["error"]["message"]
    assert_serves_a_good_request(tiny_worker)


def test_health_needs_no_key_but_everything_else_does(tiny_worker):
    status, body = tiny_worker.request("GET", "/health", auth=False)
    assert status == 200 and body == {"status": "ready"}
    status, body = tiny_worker.request("GET", "/health")
    assert status == 200 and body == {"status": "ready", "engine": "transformers", "model": tiny_worker.model}
    for path in ("/metrics", "/v1/models"):
        assert tiny_worker.request("GET", path, auth=False)[0] == 401


def test_localhost_names_are_accepted_as_host(tiny_worker):
    for host in (f"localhost:{tiny_worker.port}", f"127.0.0.1:{tiny_worker.port}"):
        status, _ = tiny_worker.request("GET", "/v1/models", headers={"Host": host})
        assert status == 200
    status, _ = tiny_worker.request("GET", "/v1/models", headers={"Host": f"localhost:{tiny_worker.port + 1}"})
    assert status == 421


def test_state_file_is_private_and_names_url_and_key(tiny_worker):
    mode = stat.S_IMODE(tiny_worker.state_file.stat().st_mode)
    assert mode == 0o600
    state = json.loads(tiny_worker.state_file.read_text())
    assert set(state) == {"url", "api_key", "pid", "model", "engine", "limits"}
    assert state["url"].startswith("http://127.0.0.1:") and state["pid"] == tiny_worker.proc.pid
    assert state["engine"] == "transformers" and len(state["api_key"]) >= 32


@pytest.mark.slow
def test_bad_requests_are_counted_by_status_code(tiny_worker):
    tiny_worker.request("GET", "/v1/models", auth=False)
    metrics = tiny_worker.metrics()
    assert metrics['deskeye_worker_requests_total{code="401",route="/v1/models"}'] >= 1
    assert metrics['deskeye_worker_requests_total{code="200",route="/v1/chat/completions"}'] >= 1
