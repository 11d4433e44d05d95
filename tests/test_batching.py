"""Dynamic batching on the tiny random Idefics3: rows decoded together give the answers they give alone, each
row keeps its own sampling, grammar and token limit, a finished row is answered while the others decode, one
thread calls the model, and preprocessing happens off that thread. Nothing here is timed: batches are made
likely with a long wait window (a batch starts at once when every request known to be coming is in it).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from inference_worker.config import WorkerConfig
from inference_worker.engines import EngineOptions, load_hf_engine
from inference_worker.engines.base import run_one
from inference_worker.metrics import WorkerMetrics
from inference_worker.protocol import parse_chat_request
from deskeye.prompt import build_messages, deskeye_response_format
from inference_worker.serving.service import ModelService
from tests.fixtures.chat_requests import chat_request, png_bytes, with_sampling
from tests.fixtures.forward_spy import recording_forwards
from tests.fixtures.worker import running_worker

pytestmark = [pytest.mark.model, pytest.mark.subprocess]

COLORS = [(220, 30, 30), (30, 160, 60), (30, 30, 220), (200, 200, 30), (30, 200, 200), (200, 30, 200),
          (120, 60, 10), (10, 60, 120)]
QUESTIONS = ["What is on this screen?", "Which window has focus?", "List the buttons.", "Any errors shown?",
             "What is the title?", "Summarise the text.", "What app is this?", "Is there a dialog?"]
LONG_WINDOW_MS = "3000,3000,3000"      # batches wait for all 8; a full batch starts at once


@pytest.fixture(scope="module")
def engine(tiny_idefics3_dir):
    engine = load_hf_engine(str(tiny_idefics3_dir), EngineOptions(device="cpu", num_threads=1), progress=False)
    yield engine
    engine.close()


def mixed_requests():
    """Rows that differ in everything a row may differ in: image, question, token limit, sampling, schema."""
    rows = []
    for i in range(6):
        request, images = chat_request(QUESTIONS[i], png_bytes(COLORS[i]), deskeye_schema=i % 3 == 0,
                                       max_tokens=[64, 5, 17, 64, 9, 24][i])
        if i == 2:
            request = with_sampling(request, temperature=0.9, top_p=0.9, top_k=50, seed=7)
        rows.append((request, images))
    return rows


def run_batch(engine, requests) -> dict:
    answers = {}
    engine.run_batch([engine.prepare(r) for r, images in requests],
                     lambda index, answer: answers.__setitem__(index, answer))
    return answers


def test_batched_rows_each_equal_their_solo_run(engine):
    requests = mixed_requests()
    solo = [run_one(engine, request) for request, images in requests]
    batched = run_batch(engine, requests)

    assert sorted(batched) == list(range(len(requests)))
    for index, alone in enumerate(solo):
        together = batched[index]
        assert (together.text, together.finish_reason, together.completion_tokens) == (
            alone.text, alone.finish_reason, alone.completion_tokens), f"row {index}"
        assert together.facts.batch_size == len(requests) and alone.facts.batch_size == 1
        assert together.facts.constrained == (requests[index][0].json_schema is not None)
    assert [batched[i].completion_tokens for i in (1, 4)] == [5, 9]          # each row's own token limit


def test_a_short_row_is_answered_while_longer_rows_still_decode(engine):
    calls = []
    requests = [chat_request(q, png_bytes(c), max_tokens=n)
                for q, c, n in zip(QUESTIONS, COLORS, (40, 3, 12))]
    done = []
    with recording_forwards(engine, lambda kwargs: calls.append(kwargs["input_ids"].shape)):
        engine.run_batch([engine.prepare(r) for r, images in requests],
                         lambda index, answer: done.append((index, len(calls), answer.completion_tokens)))

    assert [index for index, _, _ in done] == [1, 2, 0]
    (_, calls_short, _), (_, calls_mid, _), (_, calls_long, tokens_long) = done
    assert calls_short < calls_mid < calls_long == len(calls)     # answered while the model kept going
    decode_rows = [shape[0] for shape in calls if shape[1] == 1]
    assert decode_rows == sorted(decode_rows, reverse=True) and decode_rows[0] == 3 and decode_rows[-1] == 1
    assert tokens_long == 40


def test_one_thread_calls_the_model_and_preprocessing_runs_off_it(tiny_idefics3_dir):
    model_threads, prepare_threads = set(), set()

    def load_with_spies(progress):
        engine = load_hf_engine(str(tiny_idefics3_dir), EngineOptions(device="cpu", num_threads=1), progress=False)
        prepare = engine.prepare
        for module in engine.model.modules():          # every call into the model, its text decoder included
            module.register_forward_pre_hook(lambda *_: model_threads.add(threading.current_thread().name))

        def spy_prepare(request, images):
            prepare_threads.add(threading.current_thread().name)
            return prepare(request, images)
        engine.prepare = spy_prepare
        return engine

    config = WorkerConfig(max_batch_size=8, batch_window_ms=(3000, 3000, 3000), max_retries=0)
    service = ModelService(load_with_spies, config, metrics=WorkerMetrics())
    service.start()
    try:
        _wait_ready(service)
        requests = [parse_chat_request({"messages": build_messages(q, png_bytes(c)), "max_tokens": 6})
                    for q, c in zip(QUESTIONS, COLORS)]
        answers = all_at_once(lambda r: service.answer(r, timeout_s=120), requests)
    finally:
        service.stop()
    assert all(a.completion_tokens == 6 for a in answers)
    assert model_threads == {"deskeye-model"}
    assert prepare_threads and all(name.startswith("deskeye-prepare") for name in prepare_threads)
    assert max(a.facts.batch_size for a in answers) > 1


def all_at_once(call, items) -> list:
    """call(item) for every item from its own thread, all released together."""
    start = threading.Barrier(len(items))

    def released(item):
        start.wait()
        return call(item)
    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(released, items))


def _wait_ready(service: ModelService) -> None:
    ready = threading.Event()
    while service.state == "loading" and not ready.wait(0.02):
        pass
    assert service.state == "ready", service.load_error


# ---------------------------------------------------------------- through the worker process

@pytest.fixture(scope="module")
def batch_worker(tiny_idefics3_dir, tmp_path_factory):
    """A worker that gathers up to 8 requests (long window) and keeps no frame KV."""
    args = ["--engine", "transformers", "--model", str(tiny_idefics3_dir), "--threads", "1",
            "--max-batch-size", "8", "--batch-window-ms", LONG_WINDOW_MS, "--no-kv-reuse"]
    with running_worker(args, tmp_path_factory.mktemp("batch_worker")) as handle:
        yield handle


def deskeye_body(question: str, color) -> dict:
    return {"model": "deskeye", "messages": build_messages(question, png_bytes(color, (320, 200))),
            "response_format": deskeye_response_format(), "temperature": 0, "max_tokens": 200}


@pytest.mark.slow
def test_eight_requests_sent_together_are_batched_and_each_gets_its_solo_answer(tiny_worker, batch_worker):
    bodies = [deskeye_body(q, c) for q, c in zip(QUESTIONS, COLORS)]
    solo = [tiny_worker.request("POST", "/v1/chat/completions", body) for body in bodies]   # one at a time
    before = batch_worker.metrics()
    together = all_at_once(lambda b: batch_worker.request("POST", "/v1/chat/completions", b), bodies)
    after = batch_worker.metrics_after(before, num_requests=8)

    assert [status for status, _ in solo + together] == [200] * 16
    for (_, alone), (_, batched) in zip(solo, together):
        assert batched["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]
        assert batched["deskeye"]["kv_cache"] == "off"
    new_batches = after["deskeye_worker_batch_size_count"] - before["deskeye_worker_batch_size_count"]
    new_single = (after['deskeye_worker_batch_size_bucket{le="1"}']
                  - before['deskeye_worker_batch_size_bucket{le="1"}'])
    assert after["deskeye_worker_batch_size_sum"] - before["deskeye_worker_batch_size_sum"] >= 8
    assert new_batches - new_single >= 1                      # at least one batch of more than one request
    assert max(b["deskeye"]["batch_size"] for _, b in together) > 1
    assert after["deskeye_worker_batch_window_seconds"] == 3.0


@pytest.mark.slow
def test_metrics_show_queue_window_load_and_cache(tiny_worker):
    before = tiny_worker.metrics()
    status, body = tiny_worker.request("POST", "/v1/chat/completions", deskeye_body("Anything?", (1, 2, 3)))
    after = tiny_worker.metrics_after(before, num_requests=1)
    assert status == 200 and set(body["deskeye"]["timing"]) >= {"queue_ms", "ttft_ms", "decode_ms", "total_ms"}
    assert after["deskeye_worker_queue_wait_seconds_count"] > before["deskeye_worker_queue_wait_seconds_count"]
    assert after["deskeye_worker_batch_window_seconds"] in (0.05, 0.15, 0.2)       # the default levels
    assert 0 <= after["deskeye_worker_load_percent"] <= 100
    assert after['deskeye_worker_kv_cache_lookups_total{result="miss"}'] >= 1
    assert after["deskeye_worker_kv_cache_entries"] >= 1 and after["deskeye_worker_kv_cache_bytes"] > 0
    assert "deskeye_worker_queue_depth" in after


@pytest.mark.slow
def test_metrics_show_where_the_model_threads_time_went(tiny_worker):
    """The model thread's wall and CPU time in model calls and the process's CPU advance with a request; the thread's
    CPU never exceeds its wall time (what is left it waited for the GIL or a core). benchmarks.throughput reads these."""
    busy, cpu, process = ("deskeye_worker_model_busy_seconds_total", "deskeye_worker_model_cpu_seconds_total",
                          "process_cpu_seconds_total")
    before = tiny_worker.metrics()
    status, _ = tiny_worker.request("POST", "/v1/chat/completions", deskeye_body("Anything?", (4, 5, 6)))
    after = tiny_worker.metrics_after(before, num_requests=1)
    grown = {key: after[key] - before[key] for key in (busy, cpu, process)}

    assert status == 200
    assert all(value > 0 for value in grown.values()), grown
    assert grown[cpu] <= grown[busy] + 0.01, grown          # thread_time ticks are coarser than the monotonic clock
    assert grown[process] >= grown[cpu] - 0.01, grown       # the model thread is one of the process's threads


def test_a_row_the_model_cannot_prefill_fails_alone(engine):
    """An engine failure on one request (here: its image tensor cut in half, as a broken processor output would
    be) is that request's answer; the rows batched with it are answered as if it were not there."""
    requests = [chat_request(q, png_bytes(c), max_tokens=8) for q, c in zip(QUESTIONS[:3], COLORS)]
    solo = [run_one(engine, r) for r, images in requests]
    items = [engine.prepare(r) for r, images in requests]
    pixels = items[1].inputs.vision["pixel_values"]
    items[1].inputs.vision["pixel_values"] = pixels[..., : pixels.shape[-1] // 2]
    answers = {}
    engine.run_batch(items, lambda index, answer: answers.__setitem__(index, answer))

    assert isinstance(answers[1], Exception)
    assert [answers[i].text for i in (0, 2)] == [solo[0].text, solo[2].text]
    assert answers[0].facts.batch_size == 2          # the rows that decoded together: the failed one never did
