"""One bad row never costs its neighbours their answers (issue 11, batch poisoning; issue 12, engine bugs), through
the real worker and its service: a schema llguidance refuses is that request's 400 while the three good requests
batched with it get 200 and their solo answers; the grammar is compiled while preparing (never on the model thread);
a request that timed out is cancelled, stops decoding and is never retried.
"""

from __future__ import annotations

import threading
import time

import pytest

from inference_worker.config import WorkerConfig
from inference_worker.engines import EngineOptions, load_hf_engine
from inference_worker.engines.hf.grammar import SchemaGrammars
from inference_worker.metrics import WorkerMetrics
from inference_worker.protocol import parse_chat_request
from deskeye.prompt import build_messages, deskeye_response_format
from inference_worker.serving.service import ModelService, ServiceError
from tests.fixtures.chat_requests import png_bytes
from tests.fixtures.worker import running_worker
from tests.test_batching import all_at_once

pytestmark = [pytest.mark.model, pytest.mark.subprocess]

#: passes jsonschema's check_schema; llguidance refuses the lookbehind
LOOKBEHIND_SCHEMA = {"type": "string", "pattern": "(?<=a)b"}
#: a string of at least 3000 characters: more than 1024 tokens of this tokenizer, so the row cannot end before its
#: token limit (or a cancel), and an answer cut off at the limit would be retried
LONG_FORMAT = {"type": "json_schema", "json_schema": {"name": "log", "schema": {
    "type": "object", "properties": {"log": {"type": "string", "minLength": 3000}}, "required": ["log"]}}}
COLORS = [(220, 30, 30), (30, 160, 60), (30, 30, 220), (200, 200, 30)]


@pytest.fixture(scope="module")
def gathering_worker(tiny_idefics3_dir, tmp_path_factory):
    """A worker that waits up to 3 s for 8 requests to batch (a batch holding every expected request starts at once)."""
    args = ["--engine", "transformers", "--model", str(tiny_idefics3_dir), "--threads", "1",
            "--max-batch-size", "8", "--batch-window-ms", "3000,3000,3000"]
    with running_worker(args, tmp_path_factory.mktemp("gathering_worker")) as handle:
        yield handle


def body(question: str, color, response_format: dict) -> dict:
    return {"model": "deskeye", "messages": build_messages(question, png_bytes(color, (160, 120))),
            "response_format": response_format, "temperature": 0, "max_tokens": 200}


@pytest.mark.slow
def test_a_schema_the_grammar_refuses_fails_only_its_own_row(gathering_worker):
    good = [body(f"What is on screen {i}?", COLORS[i], deskeye_response_format()) for i in range(3)]
    bad = body("And this one?", COLORS[3], {"type": "json_schema",
                                           "json_schema": {"name": "bad", "schema": LOOKBEHIND_SCHEMA}})
    solo = [gathering_worker.request("POST", "/v1/chat/completions", b) for b in good]
    together = all_at_once(lambda b: gathering_worker.request("POST", "/v1/chat/completions", b), [*good, bad])

    assert [status for status, _ in together] == [200, 200, 200, 400], together
    assert [reply["choices"][0]["message"]["content"] for _, reply in together[:3]] == \
        [reply["choices"][0]["message"]["content"] for _, reply in solo]
    error = together[3][1]["error"]
    assert error.get("param") == "response_format" and "schema" in error["message"].lower()
    status, _ = gathering_worker.request("POST", "/v1/chat/completions", good[0])     # still serving
    assert status == 200


def _wait_ready(service: ModelService) -> None:
    ready = threading.Event()
    while service.state == "loading" and not ready.wait(0.02):
        pass
    assert service.state == "ready", service.load_error


def test_grammars_are_compiled_on_the_preparing_threads(tiny_idefics3_dir, monkeypatch):
    compile_threads = set()
    compile_ = SchemaGrammars._compile

    def spy_compile(self, schema):
        compile_threads.add(threading.current_thread().name)
        return compile_(self, schema)
    monkeypatch.setattr(SchemaGrammars, "_compile", spy_compile)
    service = ModelService(lambda progress: load_hf_engine(
        str(tiny_idefics3_dir), EngineOptions(device="cpu", num_threads=1), progress=False),
        WorkerConfig(max_batch_size=4, max_retries=0), metrics=WorkerMetrics())
    service.start()
    try:
        _wait_ready(service)
        requests = [parse_chat_request(body(f"Q{i}?", COLORS[i], deskeye_response_format())) for i in range(2)]
        answers = all_at_once(lambda r: service.answer(r, timeout_s=120), requests)
    finally:
        service.stop()
    assert all(a.facts.constrained for a in answers)
    assert compile_threads and all(name.startswith("deskeye-prepare") for name in compile_threads)


@pytest.mark.slow
def test_a_timed_out_request_stops_decoding_and_is_not_retried(tiny_idefics3_dir):
    metrics = WorkerMetrics()
    service = ModelService(lambda progress: load_hf_engine(
        str(tiny_idefics3_dir), EngineOptions(device="cpu", num_threads=1), progress=False),
        WorkerConfig(max_batch_size=4, max_retries=2, max_tokens_limit=4096), metrics=metrics)
    service.start()
    try:
        _wait_ready(service)
        endless = parse_chat_request({"model": "deskeye", "messages": build_messages("Go on", png_bytes(COLORS[0])),
                                      "max_tokens": 1024, "response_format": LONG_FORMAT})
        with pytest.raises(ServiceError) as timed_out:
            service.answer(endless, timeout_s=0.3)
        assert timed_out.value.status == 504
        _wait_for(lambda: _sample(metrics, "engine_calls_total", outcome="cancelled") == 1)
        after = parse_chat_request(body("Next?", COLORS[1], deskeye_response_format()))
        answer = service.answer(after, timeout_s=120)             # the model thread is free again
    finally:
        service.stop()
    assert answer.finish_reason in ("stop", "length")
    assert _sample(metrics, "retries_total") == 0 and _sample(metrics, "engine_calls_total", outcome="ok") == 1
    assert _sample(metrics, "completion_tokens_total") == answer.completion_tokens   # the cancelled row: no answer


def _sample(metrics: WorkerMetrics, name: str, **labels: str) -> float:
    """The current value of the worker series `deskeye_worker_<name>` with `labels` (0 when never set)."""
    return metrics.registry.get_sample_value(f"deskeye_worker_{name}", labels) or 0.0


def _wait_for(condition, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)
