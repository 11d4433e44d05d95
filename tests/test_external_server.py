"""The app drives an external OpenAI-compatible server through the same client code (settings.worker.url).

1. Our own worker, started separately (`start_worker`), used as an external server: works, including the
   key check and the engine reported in the response's `deskeye` extra field.
2. `transformers serve` (transformers 5.24's OpenAI-compatible server) on the tiny Idefics3 fixture model:
   it loads the local folder offline and answers, but it IGNORES `response_format` (it logs "Ignoring
   unsupported fields in the request: {'response_format'}"), so the answer is unconstrained text, not
   DeskEye's JSON. The client notices (the answer does not open a JSON object), says so once, and falls back to
   prompt-and-parse: JSON asked for in the prompt, parsed leniently, one stricter retry, and at the end the
   model's text as the summary (`output_mode` "prompt_and_parse"). vLLM: tests/test_vllm_e2e.py.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from deskeye.worker import output_mode
from deskeye.worker.client import WorkerClient
from deskeye.doctor import check_external_server, check_output_mode
from deskeye.errors import AnswerError, WorkerUnavailable
from deskeye.ask.memory import ConversationMemory
from deskeye.settings import Settings, with_overrides
from deskeye.worker.supervisor import WorkerSupervisor
from inference_worker.protocol import SUMMARY_MAX_CHARS
from deskeye.prompt import DESCRIBE_QUESTION, build_messages
from tests.fixtures.polling import wait_until
from tests.fixtures.processes import stop_process
from tests.fixtures.text_image import render_text_png
from tests.fixtures.worker import running_worker, worker_env

pytestmark = [pytest.mark.model, pytest.mark.subprocess]

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


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_server_that_ignores_response_format_gets_prompt_and_parse(transformers_serve, caplog):
    """transformers serve drops response_format: the client says so once, asks for JSON in the prompt, retries with
    the stricter prompt, and (a random model writes no JSON) ends with the model's text as the summary."""
    url, output = transformers_serve
    _, client = external(url)
    png = render_text_png(["Release notes draft"])
    with caplog.at_level(logging.INFO, logger="deskeye.worker.client"):
        first = client.ask(DESCRIBE_QUESTION, png, max_tokens=24)
        second = client.ask(DESCRIBE_QUESTION, png, max_tokens=24)
    assert first.output_mode == second.output_mode == output_mode.PROMPT_AND_PARSE
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "ignores response_format" in r.message]
    assert len(warnings) == 1 and url in warnings[0].message                       # said once, naming the server
    retries = [r.message for r in caplog.records if "asking again" in r.message]
    assert any("is_strict=True" in m for m in retries)                               # the stricter prompt was tried
    assert wait_until(lambda: _num_answered(output) >= 5, timeout_s=10)             # schema, prompt, strict, x2 ...
    log = "".join(output)
    assert log.count("Ignoring unsupported fields in the request: {'response_format'}") == 1  # ... schema only once
    assert first.summary == second.summary == _final_text(url, client, png)          # what the server said, bounded
    assert 0 < len(first.summary) <= SUMMARY_MAX_CHARS and first.key_objects == []
    assert check_external_server(client.settings).is_ok                               # and lists the model
    doctor_line = check_output_mode(client.settings)
    assert doctor_line.is_ok and doctor_line.detail.startswith("prompt_and_parse: the server IGNORES response_format")
    client.close()


def _num_answered(output: list[str]) -> int:
    return len(re.findall(r'"POST /v1/chat/completions HTTP/1.1" 200', "".join(output)))


def _final_text(url: str, client: WorkerClient, png: bytes) -> str:
    """The server's own answer to the prompt-and-parse ladder's requests, read by the openai client directly."""
    import openai

    raw = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    model = raw.models.list().data[0].id
    attempt = output_mode.Attempt(output_mode.PROMPT_AND_PARSE, 24)
    while True:
        fields = output_mode.request_fields(attempt, build_messages(DESCRIBE_QUESTION, png))
        choice = raw.chat.completions.create(model=model, temperature=0, **fields).choices[0]
        outcome = output_mode.judge(attempt, choice.message.content or "", choice.finish_reason, 24)
        if outcome.next_attempt is None:
            raw.close()
            assert outcome.description is not None
            return outcome.description.summary
        attempt = outcome.next_attempt
