"""Frame KV reuse on the tiny random Idefics3. Exact: a new question about a frame already seen reuses its
prefix KV and decodes exactly what the cold path decodes (logits compared, not only tokens). Similar: a frame
a few pixels away reuses the older frame's KV; a different screen never does; the off switches work."""

from __future__ import annotations

import io
import uuid

import pytest
import torch
from PIL import Image

from inference_worker.config import DEFAULT_KV_SIMILAR_THRESHOLD
from inference_worker.engines import EngineOptions, load_hf_engine
from deskeye.prompt import DESKEYE_SCHEMA
from deskeye.prompt import build_messages, deskeye_response_format
from tests.fixtures.chat_requests import chat_request
from tests.fixtures.text_image import render_text_png
from tests.fixtures.worker import running_worker

pytestmark = [pytest.mark.model, pytest.mark.subprocess]

KV_BYTES = 64 * 1024 * 1024


def load(model_dir, **options):
    return load_hf_engine(str(model_dir), EngineOptions(device="cpu", num_threads=1, **options), progress=False)


@pytest.fixture(scope="module")
def cold_engine(tiny_idefics3_dir):
    engine = load(tiny_idefics3_dir)
    engine.decoder.keep_logits = True
    yield engine
    engine.close()


@pytest.fixture()
def reuse_engine(tiny_idefics3_dir):
    engine = load(tiny_idefics3_dir, kv_cache_bytes=KV_BYTES, kv_similar_threshold=DEFAULT_KV_SIMILAR_THRESHOLD)
    engine.decoder.keep_logits = True
    yield engine
    engine.close()


def screen_png(*lines: str) -> bytes:
    return render_text_png(list(lines) or [f"Build {uuid.uuid4().hex[:8]} finished", "3 warnings, 0 errors"])


def with_pixels_changed(png: bytes, points=((400, 10), (401, 10), (400, 11), (401, 11))) -> bytes:
    """The same screen with a few pixels (a 2x2 dot) changed, like a cursor that moved."""
    image = Image.open(io.BytesIO(png)).convert("RGB")
    for xy in points:
        image.putpixel(xy, (255, 0, 0))
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def decode(engine, question: str, png: bytes, **body):
    """One request straight through the engine's batch decoder -> RowResult (with per-step logits)."""
    request, images = chat_request(question, png, **body)
    prepared = engine.prepare(request)
    results = []
    engine.decoder.run([engine.decoder_row(prepared)],
                       lambda index, result: results.append(result))
    return results[0]


def assert_same_decoding(a, b) -> None:
    assert a.token_ids == b.token_ids
    assert len(a.logits) == len(b.logits)
    for step, (x, y) in enumerate(zip(a.logits, b.logits)):
        finite = torch.isfinite(x)
        assert torch.equal(finite, torch.isfinite(y)), f"step {step}: different allowed tokens"
        assert torch.allclose(x[finite], y[finite], atol=1e-5, rtol=0), f"step {step}: logits differ"


@pytest.mark.parametrize("schema", [None, DESKEYE_SCHEMA], ids=["free", "deskeye-schema"])
def test_an_exact_hit_decodes_what_the_cold_path_decodes(cold_engine, reuse_engine, schema):
    png = screen_png()
    body = {"max_tokens": 24}
    if schema is not None:
        body["response_format"] = deskeye_response_format()
    cold_first = decode(cold_engine, "What is on this screen?", png, **body)
    cold_second = decode(cold_engine, "Which window has focus?", png, **body)

    first = decode(reuse_engine, "What is on this screen?", png, **body)
    second = decode(reuse_engine, "Which window has focus?", png, **body)        # another question, same frame
    again = decode(reuse_engine, "What is on this screen?", png, **body)

    assert (cold_first.kv_cache, first.kv_cache, second.kv_cache, again.kv_cache) == ("off", "miss", "exact", "exact")
    assert_same_decoding(first, cold_first)          # prefix and suffix prefilled apart = one whole prefill
    assert_same_decoding(second, cold_second)
    assert_same_decoding(again, cold_first)
    assert reuse_engine.frame_cache.num_entries == 1 and reuse_engine.frame_cache.num_exact_hits == 2


def test_a_similar_hit_reuses_the_older_frame_and_a_different_screen_misses(reuse_engine, tiny_idefics3_dir):
    png = screen_png()
    decode(reuse_engine, "What is on this screen?", png, max_tokens=4)
    nudged = with_pixels_changed(png)
    similar = decode(reuse_engine, "What is on this screen?", nudged, max_tokens=24)
    other = decode(reuse_engine, "What is on this screen?", screen_png("Inbox (3 unread)", "Meeting at 14:30"),
                   max_tokens=4)

    assert (similar.kv_cache, other.kv_cache) == ("similar", "miss")
    # the approximation, stated: the model answered from the older frame's KV
    from_old_frame = decode(load(tiny_idefics3_dir), "What is on this screen?", png, max_tokens=24)
    assert similar.token_ids == from_old_frame.token_ids


def test_the_similar_level_can_be_switched_off(tiny_idefics3_dir):
    engine = load(tiny_idefics3_dir, kv_cache_bytes=KV_BYTES, kv_similar_threshold=None)
    png = screen_png()
    assert decode(engine, "What is on this screen?", png, max_tokens=2).kv_cache == "miss"
    assert decode(engine, "What is on this screen?", with_pixels_changed(png), max_tokens=2).kv_cache == "miss"
    assert decode(engine, "What is on this screen?", png, max_tokens=2).kv_cache == "exact"


# ---------------------------------------------------------------- through the worker process

def ask(worker, question: str, png: bytes) -> dict:
    status, body = worker.request("POST", "/v1/chat/completions", {
        "model": "deskeye", "messages": build_messages(question, png), "response_format": deskeye_response_format(),
        "temperature": 0, "max_tokens": 1024})   # room for a whole answer: a retry would hit the cache
    assert status == 200, body
    return body


@pytest.mark.slow
def test_reuse_levels_through_the_worker_and_its_metrics(tiny_worker):
    png = screen_png()
    before = tiny_worker.metrics()
    cold = ask(tiny_worker, "What is on this screen?", png)
    exact = ask(tiny_worker, "What is on this screen?", png)
    similar = ask(tiny_worker, "What is on this screen?", with_pixels_changed(png))
    other = ask(tiny_worker, "What is on this screen?", screen_png("Calendar: standup 09:30", "Week 48"))
    after = tiny_worker.metrics()

    levels = [body["deskeye"]["kv_cache"] for body in (cold, exact, similar, other)]
    assert levels == ["miss", "exact", "similar", "miss"]
    assert exact["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
    for level, count in (("exact", 1), ("similar", 1), ("miss", 2)):
        key = f'deskeye_worker_kv_cache_lookups_total{{result="{level}"}}'
        assert after.get(key, 0) - before.get(key, 0) >= count     # retries look up again


@pytest.mark.slow
def test_no_kv_reuse_and_no_kv_similar_switches(tiny_idefics3_dir, tmp_path):
    base = ["--engine", "transformers", "--model", str(tiny_idefics3_dir), "--threads", "1"]
    png = screen_png()
    with running_worker([*base, "--no-kv-similar"], tmp_path / "exact_only") as worker:
        levels = [ask(worker, "What is on this screen?", p)["deskeye"]["kv_cache"]
                  for p in (png, with_pixels_changed(png), png)]
        assert levels == ["miss", "miss", "exact"]
    with running_worker([*base, "--no-kv-reuse"], tmp_path / "off") as worker:
        levels = [ask(worker, "What is on this screen?", p)["deskeye"]["kv_cache"] for p in (png, png)]
        assert levels == ["off", "off"]
        assert worker.metrics()["deskeye_worker_kv_cache_entries"] == 0
