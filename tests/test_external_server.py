"""The app drives an external OpenAI-compatible server through the same client code (settings.worker.url).

1. Our own worker, started separately (`start_worker`), used as an external server: works, including the
   key check and the engine reported in the response's `deskeye` extra field.
2. `transformers serve` (transformers 5.24's OpenAI-compatible server) on the tiny Idefics3 fixture model:
   it loads the local folder offline and answers, but it IGNORES `response_format` (it logs "Ignoring
   unsupported fields in the request: {'response_format'}"), so the answer is unconstrained text, not
   DeskEye's JSON. The test shows exactly that failure and the client's message for it. DeskEye needs a
   server with JSON-schema output: vLLM, SGLang, llama.cpp server, Ollama.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from deskeye.client import WorkerClient
from deskeye.doctor import check_external_server
from deskeye.errors import AnswerError, WorkerUnavailable
from deskeye.memory import ConversationMemory
from deskeye.settings import Settings, with_overrides
from deskeye.supervisor import WorkerSupervisor
from tests.fixtures.polling import wait_until
from tests.fixtures.processes import stop_process
from tests.fixtures.text_image import render_text_png
from tests.fixtures.worker import running_worker, worker_env

SERVE_START_TIMEOUT_S = 120.0


def external(url: str, **worker) -> tuple[WorkerSupervisor, WorkerClient]:
    settings = with_overrides(Settings(), worker={"url": url, "request_timeout_s": 60.0, **worker})
    supervisor = WorkerSupervisor(settings)
    supervisor.start()
    return supervisor, WorkerClient(supervisor, settings)


@pytest.fixture(scope="module")
def ocr_worker(tmp_path_factory):
    with running_worker(["--engine", "ocr"], tmp_path_factory.mktemp("external_ocr")) as handle:
        yield handle


def test_our_worker_as_an_external_server(ocr_worker):
    supervisor, client = external(f"{ocr_worker.url}/v1", api_key=ocr_worker.api_key)
    memory = ConversationMemory(3)
    memory.add("What was on screen before?", '{"summary": "a terminal", "key_objects": []}')
    answer = client.ask("What is on this screen?", render_text_png(["Release notes draft"]), memory.turns())
    assert supervisor.state == "external" and supervisor.pid is None       # no process of ours
    assert answer.engine == "ocr"                                           # from the `deskeye` extra field
    assert "release" in answer.summary.lower() and "notes" in answer.summary.lower()
    assert check_external_server(supervisor.settings).is_ok
    client.close()


def test_a_wrong_key_is_reported_with_how_to_fix_it(ocr_worker, monkeypatch):
    monkeypatch.setenv("DESKEYE_WORKER_API_KEY", "not-the-key")
    _, client = external(ocr_worker.url)                                    # key from the environment variable
    with pytest.raises(WorkerUnavailable, match="rejected the API key. Set worker.api_key, or the environment "
                                                "variable DESKEYE_WORKER_API_KEY"):
        client.ask("hi", None)
    check = check_external_server(client.settings)
    assert not check.is_ok and "HTTP 401" in check.detail


def test_server_errors_are_shown_with_what_to_fix(ocr_worker):
    _, client = external(ocr_worker.url, api_key=ocr_worker.api_key)
    with pytest.raises(AnswerError, match="rejected the request: The ocr engine reads the text in an image, "
                                          "and this request has none"):
        client.ask("What is on this screen?", None)                     # HTTP 400 from the worker
    _, client = external(ocr_worker.url, api_key=ocr_worker.api_key, remote_model="no-such-model")
    with pytest.raises(AnswerError, match=r"HTTP 404\): Unknown model 'no-such-model'.*Check worker.remote_model"):
        client.ask("What is on this screen?", render_text_png(["x"]))


@pytest.fixture(scope="module")
def transformers_serve(tiny_idefics3_dir, tmp_path_factory):
    """`transformers serve TINY_MODEL --port 0` as a subprocess, offline; yields (url, output lines)."""
    pytest.importorskip("fastapi", reason="`transformers serve` needs fastapi and uvicorn (transformers[serving])")
    pytest.importorskip("uvicorn", reason="`transformers serve` needs fastapi and uvicorn (transformers[serving])")
    command = [str(Path(sys.executable).with_name("transformers")), "serve", str(tiny_idefics3_dir),
               "--port", "0", "--device", "cpu", "--log-level", "info"]
    env = {**worker_env(), "HF_HOME": str(tmp_path_factory.mktemp("hf_home"))}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            text=True, env=env)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        yield _wait_for_uvicorn(proc, output), output
    finally:
        stop_process(proc, timeout_s=15)
        reader.join(timeout=5)


def _wait_for_uvicorn(proc: subprocess.Popen, output: list[str]) -> str:
    deadline = time.monotonic() + SERVE_START_TIMEOUT_S
    while time.monotonic() < deadline:
        for line in list(output):
            match = re.search(r"Uvicorn running on (http://\S+)", line)
            if match:
                return match.group(1)
        if proc.poll() is not None:
            pytest.fail("transformers serve exited:\n" + "".join(output[-30:]))
        time.sleep(0.1)
    pytest.fail("transformers serve did not start:\n" + "".join(output[-30:]))


def test_transformers_serve_answers_but_ignores_response_format(transformers_serve):
    url, output = transformers_serve
    _, client = external(url)
    with pytest.raises(AnswerError) as failure:
        client.ask("What is on this screen?", render_text_png(["Release notes draft"]), max_tokens=24)
    message = str(failure.value)
    assert f"The answer from {url} is not a DeskEye description" in message
    assert "may ignore response_format json_schema" in message
    log = "".join(output)
    assert "Ignoring unsupported fields in the request: {'response_format'}" in log       # the reason
    answered = r'"POST /v1/chat/completions HTTP/1.1" 200'          # the access log is written after the response
    assert wait_until(lambda: re.search(answered, "".join(output)), timeout_s=10)           # it did answer
    assert check_external_server(client.settings).is_ok                                      # and lists the model
