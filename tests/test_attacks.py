"""Hostile requests against a real `deskeye-worker` subprocess, over HTTP: each reproduces an attack that once
worked (issue 11) and shows it is now refused with a clear 4xx, nothing fetched, nothing run, nothing leaked,
and the worker still serving.

The worker serves the OCR engine (real RapidOCR): its summary quotes the question, which is how a schema
`pattern` reached the text an attacker chose. Only HTTP is used, so these hold whatever serves it.
"""

from __future__ import annotations

import base64
import io
import json
import os
import socket
import stat
import threading
import time
from pathlib import Path

import psutil
import pytest
from PIL import Image

from deskeye.prompt import DESKEYE_SCHEMA
from deskeye.prompt import deskeye_response_format
from tests.fixtures.text_image import render_text_png
from tests.fixtures.worker import running_worker

pytestmark = [pytest.mark.subprocess]

CHAT = "/v1/chat/completions"
SCREEN_LINES = ["Quarterly budget review", "Invoice 4471 overdue"]


@pytest.fixture(scope="module")
def ocr_worker(tmp_path_factory):
    with running_worker(["--engine", "ocr"], tmp_path_factory.mktemp("attacks")) as handle:
        yield handle


@pytest.fixture(scope="module")
def screen_png() -> bytes:
    return render_text_png(SCREEN_LINES)


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def chat(image: bytes, *, question: str = "What is on this screen?", schema: dict | None = None,
         mime: str = "image/png") -> dict:
    body = {"model": "deskeye", "max_tokens": 64, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(image, mime)}}, {"type": "text", "text": question}]}]}
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "attack", "schema": schema}}
    return body


def assert_client_error(status: int, body, *words: str) -> str:
    assert 400 <= status < 500, (status, body)
    error = body["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["code"] == status
    for word in words:
        assert word in error["message"], error["message"]
    return error["message"]


def assert_serves(worker, screen_png: bytes) -> None:
    status, body = worker.request("POST", CHAT, {**chat(screen_png), "response_format": deskeye_response_format()})
    assert status == 200, body
    assert "budget" in json.loads(body["choices"][0]["message"]["content"])["summary"].lower()


class Listener:
    """A TCP listener on another loopback port that counts connections; `answer=False` never replies."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.connections: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections.append(conn)             # held open, never answered: a silent server

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for conn in self.connections:
            conn.close()
        self.sock.close()


@pytest.fixture
def listener():
    server = Listener()
    yield server
    server.close()


# ------------------------------------------------------------------ schemas: nothing fetched, nothing read

def remote_schemas(port: int) -> dict[str, dict]:
    base = f"http://127.0.0.1:{port}"
    return {
        "root-ref": {"$ref": f"{base}/schema.json"},
        "nested-ref": {"type": "object", "properties": {"summary": {"$ref": f"{base}/summary.json"}}},
        "defs-ref": {"$defs": {"s": {"$ref": f"{base}/s.json#/x"}}, "$ref": "#/$defs/s"},
        "id-then-relative-ref": {"$id": f"{base}/root.json", "$ref": "other.json"},
        "metaschema": {"$schema": f"{base}/meta.json", "type": "object"},
        "dynamic-ref": {"$dynamicRef": f"{base}/meta.json#meta"},
    }


@pytest.mark.slow
def test_a_remote_ref_is_refused_and_never_fetched(ocr_worker, screen_png, listener):
    for name, schema in remote_schemas(listener.port).items():
        status, body = ocr_worker.request("POST", CHAT, chat(screen_png, schema=schema))
        message = assert_client_error(status, body, "response_format.json_schema.schema")
        assert any(word in message for word in ("$ref", "$id", "$schema", "$dynamicRef")), (name, message)
    time.sleep(0.3)                                      # a fetch in flight would have connected by now
    assert listener.connections == [], "the worker connected to the URL a schema named"
    assert_serves(ocr_worker, screen_png)


def test_a_file_ref_is_refused_without_quoting_any_file(ocr_worker, screen_png, tmp_path):
    secret_file = tmp_path / "secret.json"
    secret_file.write_text(json.dumps({"type": "string", "secret": "do-not-leak-4471"}))
    targets = [ocr_worker.state_file.resolve().as_uri(), secret_file.as_uri(), "worker.json",
               f"{ocr_worker.state_file.resolve().as_uri()}#/api_key", "/etc/passwd"]
    for target in targets:
        status, body = ocr_worker.request("POST", CHAT, chat(screen_png, schema={"$ref": target}))
        message = assert_client_error(status, body, "'$ref'", "only local references")
        text = json.dumps(body)
        assert ocr_worker.api_key not in text and "do-not-leak-4471" not in text and "root:" not in text
        assert ocr_worker.url.split("//")[1] not in message
    assert_serves(ocr_worker, screen_png)


def test_a_ref_to_a_silent_server_stalls_no_one(ocr_worker, screen_png, listener):
    attack = chat(screen_png, schema={"$ref": f"http://127.0.0.1:{listener.port}/never-answers.json"})
    results: dict[str, tuple[int, dict]] = {}

    def send(name: str, body: dict) -> None:
        results[name] = ocr_worker.request("POST", CHAT, body, timeout_s=20.0)   # the stall was ~90 s

    threads = [threading.Thread(target=send, args=("attack", attack)),
               threading.Thread(target=send, args=("good", {**chat(screen_png),
                                                           "response_format": deskeye_response_format()}))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert_client_error(*results["attack"], "only local references")
    assert results["good"][0] == 200, results["good"]
    assert listener.connections == []


def test_health_answers_within_1s_while_a_pathological_pattern_is_in_flight(ocr_worker, screen_png):
    # `(a+)+b` against the 40 a's the OCR summary quotes from the question: 2**40 steps for a backtracking matcher
    schema = {**DESKEYE_SCHEMA, "properties": {**DESKEYE_SCHEMA["properties"],
                                               "summary": {"type": "string", "pattern": "(a+)+b"}}}
    outcome: list = []
    attack = threading.Thread(target=lambda: outcome.append(ocr_worker.request(
        "POST", CHAT, chat(screen_png, question="a" * 40 + " budget", schema=schema), timeout_s=60.0)))
    attack.start()
    try:
        for _ in range(10):
            status, body = ocr_worker.request("GET", "/health", auth=False, timeout_s=1.0)   # raises past 1 s
            assert status == 200, body
            time.sleep(0.05)
    finally:
        attack.join(60)
    assert outcome, "the pathological request never finished"
    status, body = outcome[0]
    assert status == 400, body      # answered: the OCR answer cannot match that pattern
    assert_serves(ocr_worker, screen_png)


def nested_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


LOOPS = {
    "self": {"$ref": "#"},
    "pair": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    "through-allOf": {"$defs": {"a": {"allOf": [{"type": "object"}, {"$ref": "#/$defs/b"}]},
                                "b": {"anyOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"},
    "summary-self": {"type": "object", "properties": {"summary": {"$ref": "#/properties/summary"}}},
}


@pytest.mark.parametrize("name", list(LOOPS))
def test_a_ref_loop_is_refused_with_400(ocr_worker, screen_png, name):
    status, body = ocr_worker.request("POST", CHAT, chat(screen_png, schema=LOOPS[name]))
    assert_client_error(status, body, "'$ref' loop", "properties' or 'items'")


# 40 levels reach the schema check; 400 levels are refused earlier, by the request body's own depth bound
@pytest.mark.parametrize("levels, refusal", [(40, "nests deeper than 64 levels"),
                                             (400, "The request body is nested too deeply")])
def test_deep_nesting_is_refused_with_400(ocr_worker, screen_png, levels, refusal):
    status, body = ocr_worker.request("POST", CHAT, chat(screen_png, schema=nested_schema(levels)))
    assert_client_error(status, body, refusal)
    assert_serves(ocr_worker, screen_png)


def test_a_recursive_schema_that_reads_the_answer_is_accepted(ocr_worker, screen_png):
    tree = {"type": "object", "properties": {"summary": {"type": "string"}, "key_objects": {
        "type": "array", "items": {"type": "string"}}, "children": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["summary", "key_objects"]}
    status, body = ocr_worker.request("POST", CHAT, chat(screen_png, schema=tree))
    assert status == 200, body


@pytest.mark.parametrize("pattern, words", [
    ("(?<=a)b", ["lookaround"]), ("(a)\\1", ["backreferences"]), ("a" * 1001, ["1,001 characters"]),
    ("((a{1000}){1000}){1000}", ["linear-time"]),
])
def test_a_pattern_a_linear_engine_cannot_run_is_refused(ocr_worker, screen_png, pattern, words):
    schema = {"type": "object", "properties": {"summary": {"type": "string", "pattern": pattern}}}
    status, body = ocr_worker.request("POST", CHAT, chat(screen_png, schema=schema))
    assert_client_error(status, body, "pattern", *words)


def test_huge_schemas_are_refused_and_leave_no_memory_behind(ocr_worker, screen_png):
    worker = psutil.Process(ocr_worker.proc.pid)
    before_bytes = worker.memory_info().rss
    for i in range(12):                                  # 12 x 2.6 MB once kept +228 MB in the validator cache
        schema = {"type": "object", "title": f"huge-{i}", "properties": {
            f"field_{i}_{k}": {"type": "string", "description": "x" * 1300} for k in range(2_000)}}
        status, body = ocr_worker.request("POST", CHAT, chat(screen_png, schema=schema))
        assert_client_error(status, body, "bytes as JSON", "at most 262,144 bytes")
    grown_mb = (worker.memory_info().rss - before_bytes) / 2**20
    assert grown_mb < 60, f"RSS grew {grown_mb:.0f} MB after 12 refused 2.6 MB schemas"
    assert_serves(ocr_worker, screen_png)


# ------------------------------------------------------------------ images: decoded only as what they claim

def encoded(format_name: str, **options) -> bytes:
    buffer = io.BytesIO()
    image = Image.new("RGB", (48, 32), (200, 30, 30))
    if format_name in ("SPIDER",):
        image = image.convert("F")
    image.save(buffer, format=format_name, **options)
    return buffer.getvalue()


FOREIGN_FORMATS = ["TIFF", "JPEG2000", "ICO", "DDS", "SGI", "SPIDER", "QOI", "EPS"]


@pytest.mark.parametrize("format_name", FOREIGN_FORMATS)
def test_a_foreign_format_declared_png_is_refused(ocr_worker, screen_png, format_name):
    data = encoded(format_name)
    assert Image.open(io.BytesIO(data)).format in (format_name, "JPEG2000")   # PIL itself would decode it
    status, body = ocr_worker.request("POST", CHAT, chat(data))
    assert_client_error(status, body, "messages[0].content[0]", "not an image of the declared type image/png",
                        "PNG, JPEG, WebP, BMP or GIF")


def test_a_png_declared_jpeg_is_refused_and_each_allowed_type_is_read(ocr_worker, screen_png):
    status, body = ocr_worker.request("POST", CHAT, chat(screen_png, mime="image/jpeg"))
    assert_client_error(status, body, "declared type image/jpeg", "it looks like PNG")
    screen = Image.open(io.BytesIO(screen_png))
    for format_name, mime in [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp"),
                              ("BMP", "image/bmp"), ("GIF", "image/gif")]:
        buffer = io.BytesIO()
        screen.save(buffer, format=format_name)
        status, body = ocr_worker.request("POST", CHAT, chat(buffer.getvalue(), mime=mime))
        assert status == 200, (format_name, body)


def fake_ghostscript(bin_dir: Path, canary: Path) -> None:
    """A `gs` on PATH that only leaves a canary file: if PIL ever runs Ghostscript, the canary appears."""
    bin_dir.mkdir()
    script = bin_dir / "gs"
    script.write_text(f"#!/bin/sh\necho ran \"$@\" > '{canary}'\nexit 1\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


@pytest.mark.slow
def test_eps_never_reaches_ghostscript(tmp_path, monkeypatch, screen_png):
    canary = tmp_path / "gs-ran"
    fake_ghostscript(tmp_path / "bin", canary)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    eps = encoded("EPS")
    import subprocess                                    # the trap works: what PIL would run leaves the canary
    subprocess.run(["gs", "-q"], env=os.environ, check=False)
    assert canary.exists()
    canary.unlink()
    with running_worker(["--engine", "ocr"], tmp_path / "worker") as worker:
        for mime, status_wanted in [("image/png", 400), ("image/jpeg", 400), ("image/eps", 415),
                                    ("application/postscript", 415)]:
            status, body = worker.request("POST", CHAT, chat(eps, mime=mime))
            assert status == status_wanted, (mime, body)
        assert_serves(worker, screen_png)
    assert not canary.exists(), f"Ghostscript ran: {canary.read_text()}"


def test_a_fan_out_of_references_is_refused_with_400(ocr_worker, screen_png):
    levels = {f"l{i}": {"anyOf": [{"$ref": f"#/$defs/l{i + 1}"}, {"$ref": f"#/$defs/l{i + 1}"}]} for i in range(40)}
    levels["l40"] = {"type": "string"}
    status, body = ocr_worker.request("POST", CHAT, chat(screen_png, schema={"$defs": levels, "$ref": "#/$defs/l0"}))
    assert_client_error(status, body, "expand to more than 10,000 subschemas")
    assert_serves(ocr_worker, screen_png)


def test_a_huge_question_does_not_hold_the_ocr_engine(ocr_worker, screen_png):
    """Each question word is looked for in every line: 4 MB of words once held the model thread for minutes."""
    words = " ".join(f"w{i:07d}x" for i in range(400_000))
    status, body = ocr_worker.request("POST", CHAT, chat(screen_png, question=f"budget {words}"), timeout_s=60.0)
    assert status == 200, body
    assert "budget" in body["choices"][0]["message"]["content"].lower()
    assert ocr_worker.request("GET", "/health", auth=False, timeout_s=1.0)[0] == 200


@pytest.mark.slow
def test_hostile_screen_text_is_matched_in_bounded_time():
    """Screen text is attacker content too (a web page): 60 lines of 4,000 'a.' would take the vocabulary's
    patterns ~1 s each; only a line's start is matched."""
    from inference_worker.engines.ocr.engine import MAX_LINE_CHARS, describe_reads
    from inference_worker.engines.ocr.reader import OcrLine, ReadResult

    lines = tuple(OcrLine("a." * 2000, (0, 20 * i, 7000, 20 * i + 18), 0.9) for i in range(60))
    read = ReadResult(lines, ((0, 0, 7680, 1300),), True, (7680, 1300), 0.1)
    result: list = []
    worker = threading.Thread(target=lambda: result.append(describe_reads([read], "what is this")), daemon=True)
    worker.start()
    worker.join(20)
    assert result, "describing hostile lines did not finish"
    assert all(len(line) <= MAX_LINE_CHARS for line in result[0].summary.split("\n"))
