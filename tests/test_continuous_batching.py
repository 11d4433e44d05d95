"""Continuous batching on tiny random models of three families: rows that join a running decode (between its steps)
get, step by step, the logits they get alone (1e-5), whether they are prefilled cold or from an exact frame hit
(suffix only); rows that leave free their row at once; a bad row — a failing completion callback, a cancelled
client — ends alone. MiniCPM-V 4.6's text model is hybrid (a linear-attention layer with conv and recurrent
state, and a full-attention layer): its caches merge and shrink along the batch like plain ones.
"""

from __future__ import annotations

import pytest
import torch

from inference_worker.engines.base import RowCancelled
from inference_worker.engines import EngineOptions, load_hf_engine
from tests.fixtures.chat_requests import chat_request, png_bytes, with_sampling
from tests.fixtures.forward_spy import recording_forwards

pytestmark = [pytest.mark.model]

KV_BYTES = 64 * 1024 * 1024
COLORS = [(220, 30, 30), (30, 160, 60), (30, 30, 220), (200, 200, 30), (30, 200, 200), (200, 30, 200)]
QUESTIONS = ["What is on this screen?", "Which window has focus?", "List the buttons.", "Any errors shown?",
             "What is the title?", "Summarise the text."]


@pytest.fixture(scope="module", params=["idefics3", "llava", "minicpmv46"])
def engine(request):
    folder = request.getfixturevalue(f"tiny_{request.param}_dir")
    engine = load_hf_engine(str(folder), EngineOptions(device="cpu", num_threads=1, kv_cache_bytes=KV_BYTES),
                            progress=False)
    engine.decoder.keep_logits = True
    yield engine
    engine.close()


def requests_for_join():
    """Rows of different lengths, limits, sampling and schemas (several steps each, so joins land mid-decode)."""
    rows = []
    for i in range(5):
        request, images = chat_request(QUESTIONS[i], png_bytes(COLORS[i]), deskeye_schema=i % 2 == 1,
                                       max_tokens=[24, 9, 16, 12, 20][i])
        if i == 3:
            request = with_sampling(request, temperature=0.8, top_p=0.9, top_k=40, seed=11)
        rows.append((request, images))
    return rows


def solo(engine, request, images):
    """The row decoded alone, with the frame cache out of the way (a cold prefill)."""
    results = []
    item = engine.prepare(request)
    item.inputs.frame = None
    engine.decoder.run([engine.decoder_row(item)], lambda index, result: results.append(result))
    assert not isinstance(results[0], Exception), results[0]
    return results[0]


def joining(engine, items, join_at: dict[int, list[int]], *, on_step=None):
    """Row 0 starts alone; at take_more call k the items join_at[k] join. Returns {index: result}."""
    results, calls = {}, [0]

    def take_more(num_live):
        calls[0] += 1
        if on_step is not None:
            on_step(calls[0])
        return [(i, engine.decoder_row(items[i])) for i in join_at.get(calls[0], [])]
    engine.decoder.run_indexed([(0, engine.decoder_row(items[0]))],
                               lambda index, result: results.__setitem__(index, result), take_more)
    return results


def assert_same_logits(batched, alone, label: str) -> None:
    assert batched.token_ids == alone.token_ids, label
    assert len(batched.logits) == len(alone.logits), label
    for step, (x, y) in enumerate(zip(batched.logits, alone.logits)):
        finite = torch.isfinite(x)
        assert torch.equal(finite, torch.isfinite(y)), f"{label} step {step}: different allowed tokens"
        assert torch.allclose(x[finite], y[finite], atol=1e-5, rtol=0), \
            f"{label} step {step}: logits differ by {(x[finite] - y[finite]).abs().max():.2e}"


@pytest.mark.slow
def test_rows_joining_mid_decode_get_the_logits_they_get_alone(engine):
    requests = requests_for_join()
    alone = [solo(engine, r, images) for r, images in requests]
    items = [engine.prepare(r) for r, images in requests]
    for item in items:
        item.inputs.frame = None                       # cold prefills here; exact hits below
    results = joining(engine, items, {2: [1, 2], 5: [3], 9: [4]})

    assert sorted(results) == list(range(len(items)))
    for index, result in results.items():
        assert not isinstance(result, Exception), result
        assert_same_logits(result, alone[index], f"row {index}")
        assert result.is_constrained == (requests[index][0].json_schema is not None)
    assert [len(results[i].token_ids) for i in (1, 3)] == [9, 12]          # each row's own token limit
    assert max(r.batch_size for r in results.values()) >= 3                 # rows really decoded together
    assert engine.decoder.live_rows == 0


def test_a_row_joining_on_an_exact_frame_hit_prefills_only_its_suffix_and_matches_the_cold_path(engine):
    png = png_bytes((90, 10, 160))
    first, first_images = chat_request("What is on this screen?", png, max_tokens=14)
    other, other_images = chat_request("Which window has focus?", png, max_tokens=10)
    long, long_images = chat_request(QUESTIONS[2], png_bytes(COLORS[2]), max_tokens=20)
    alone = solo(engine, other, other_images)
    engine.frame_cache.clear()

    warm = engine.prepare(first)
    engine.run_batch([warm], lambda index, answer: None)               # stores the frame's prefix
    items = [engine.prepare(long), engine.prepare(other)]
    forwards = []

    def count(kwargs):
        ids = kwargs.get("input_ids")
        forwards.append(None if ids is None else tuple(ids.shape))
    with recording_forwards(engine, count):
        results = joining(engine, items, {3: [1]})

    assert results[1].kv_cache == "exact"
    assert_same_logits(results[1], alone, "exact-hit joiner")
    suffix_length = int(items[1].inputs.suffix_ids.shape[1])
    assert (1, suffix_length) in forwards                    # the joiner's prefill: its suffix, nothing else
    assert (1, items[1].inputs.num_tokens) not in forwards


@pytest.mark.slow
def test_a_failing_completion_callback_fails_only_its_row(engine):
    requests = requests_for_join()[:3]
    alone = [solo(engine, r, images) for r, images in requests]
    items = [engine.prepare(r) for r, images in requests]
    seen: dict[int, list] = {0: [], 1: [], 2: []}

    def on_done(index, answer):
        seen[index].append(answer)
        if index == 1 and not isinstance(answer, Exception):
            raise RuntimeError("the client's socket broke while answering")
    engine.run_batch(items, on_done)

    assert [type(a).__name__ for a in seen[1]] == ["Completion", "RuntimeError"]
    assert [seen[i][0].text for i in (0, 2)] == [engine._completion(alone[i]).text for i in (0, 2)]
    assert len(seen[0]) == len(seen[2]) == 1


@pytest.mark.slow
def test_a_cancelled_row_stops_at_its_next_step_and_the_others_are_answered(engine):
    requests = requests_for_join()[:3]
    requests[1] = chat_request(QUESTIONS[1], png_bytes(COLORS[1]), max_tokens=40)
    alone = [solo(engine, r, images) for r, images in requests]
    items = [engine.prepare(r) for r, images in requests]
    for item in items:
        item.inputs.frame = None
    results = joining(engine, items, {1: [1, 2]},
                      on_step=lambda call: call == 4 and items[1].cancelled.set())

    assert isinstance(results[1], RowCancelled)
    for index in (0, 2):
        assert_same_logits(results[index], alone[index], f"row {index}")


def test_a_row_cancelled_before_it_starts_never_runs(engine):
    request, images = chat_request("Anything?", png_bytes(COLORS[0]), max_tokens=8)
    item = engine.prepare(request)
    item.cancelled.set()
    answers = []
    engine.run_batch([item], lambda index, answer: answers.append(answer))
    assert len(answers) == 1 and isinstance(answers[0], RowCancelled)


def test_finished_rows_leave_and_the_batch_shrinks_to_the_rows_still_going(engine):
    """Rows leave the moment they end: the forward's batch shrinks step by step (and the cache with it)."""
    requests = [chat_request(q, png_bytes(c), max_tokens=n) for q, c, n in zip(QUESTIONS, COLORS, (18, 4, 9))]
    items = [engine.prepare(r) for r, images in requests]
    shapes = []

    def count(kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] == 1:
            shapes.append(ids.shape[0])
    done = []
    with recording_forwards(engine, count):
        engine.run_batch(items, lambda index, answer: done.append(index))
    assert done == [1, 2, 0]
    assert shapes == sorted(shapes, reverse=True) and shapes[0] == 3 and shapes[-1] == 1


def test_a_row_given_as_prefix_embeddings_decodes_like_its_token_ids(engine):
    """The seam for engines that build their own multimodal embeddings (MiniCPM-o): a row whose prefix comes as
    `inputs_embeds` gets the logits of the same prompt given as token ids, alone and joining mid-decode."""
    from dataclasses import replace

    request, _ = chat_request("Describe the text on this screen, please.", max_tokens=12)
    item = engine.prepare(request)
    ids = item.inputs.all_ids()
    split = ids.shape[1] // 2
    as_ids = replace(item.inputs, prefix_ids=ids[:, :split], suffix_ids=ids[:, split:], vision={}, frame=None)
    with torch.inference_mode():
        embeds = engine.model.get_input_embeddings()(ids[:, :split])
    as_embeds = replace(as_ids, prefix_embeds=embeds)
    by_ids, by_embeds = replace(item, inputs=as_ids), replace(item, inputs=as_embeds)
    alone = solo_item(engine, by_ids)
    embedded_alone = solo_item(engine, by_embeds)
    long, long_images = chat_request(QUESTIONS[0], png_bytes(COLORS[0]), max_tokens=20)
    first = engine.prepare(long)
    first.inputs.frame = None
    results = joining(engine, [first, by_embeds], {3: [1]})

    assert_same_logits(embedded_alone, alone, "embeddings alone")
    assert_same_logits(results[1], alone, "embeddings joining")


def solo_item(engine, item):
    results = []
    engine.decoder.run([engine.decoder_row(item)], lambda index, result: results.append(result))
    assert not isinstance(results[0], Exception), results[0]
    return results[0]


@pytest.mark.slow
def test_cold_rows_joining_together_are_prefilled_in_one_forward(engine):
    """The joiners' prompts go through one left-padded forward (position_ids = cumsum(mask)-1) and still get their
    solo logits: Idefics3 and LLaVA stack their images along the batch, MiniCPM-V 4.6 packs them NaViT-style and its
    linear-attention states take no padding in (tests/test_batched_prefill.py goes further)."""
    requests = requests_for_join()[:3]
    alone = [solo(engine, r, images) for r, images in requests]
    items = [engine.prepare(r) for r, images in requests]
    for item in items:
        item.inputs.frame = None
    prefills, forward = [], engine.model.forward

    def counting_forward(*args, **kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] > 1:
            prefills.append(ids.shape[0])
        return forward(*args, **kwargs)
    engine.model.forward = counting_forward
    try:
        results = joining(engine, items, {2: [1, 2]})
    finally:
        del engine.model.forward

    for index in range(3):
        assert_same_logits(results[index], alone[index], f"row {index}")
    assert prefills == [1, 2]


@pytest.mark.slow
def test_padded_decode_steps_hand_a_plain_attention_model_its_4d_mask_with_the_2d_masks_logits(engine):
    """Under sdpa with plain attention (Idefics3, LLaVA) a step over left-padded rows passes the 4-D boolean mask
    (transformers uses it as it is instead of rebuilding it each step); the logits are those the 2-D mask gives.
    A hybrid model (4.6: its linear layer reads the 2-D mask) always gets the 2-D mask."""
    is_hybrid = engine.model.config.model_type == "minicpmv4_6"
    assert engine.decoder.prebuilds_step_mask == (not is_hybrid)
    requests = requests_for_join()
    seen: dict[bool, list[int]] = {}

    def run(prebuilds: bool):
        ranks = seen.setdefault(prebuilds, [])
        engine.decoder.prebuilds_step_mask = prebuilds and not is_hybrid
        try:
            with recording_forwards(engine, lambda kwargs: ranks.append(kwargs["attention_mask"].ndim)):
                return cold_joins(engine, requests)
        finally:
            engine.decoder.prebuilds_step_mask = not is_hybrid

    with_4d, with_2d = run(True), run(False)
    assert (4 in seen[True]) == (not is_hybrid) and 4 not in seen[False]
    assert_same_runs(with_4d, with_2d)


def cold_joins(engine, requests):
    """The requests cold (no frame reuse), row 0 alone first and the others joining mid-decode."""
    items = [engine.prepare(r) for r, images in requests]
    for item in items:
        item.inputs.frame = None
    return joining(engine, items, {2: [1, 2], 5: [3], 9: [4]})


def assert_same_runs(results, reference) -> None:
    """Every row: the same tokens and, step by step, the same allowed tokens and logits (1e-6)."""
    assert sorted(results) == sorted(reference)
    for index in reference:
        assert results[index].token_ids == reference[index].token_ids
        for x, y in zip(results[index].logits, reference[index].logits):
            finite = torch.isfinite(y)
            assert torch.equal(torch.isfinite(x), finite)
            assert torch.allclose(x[finite], y[finite], atol=1e-6, rtol=0)


@pytest.mark.slow
def test_decode_steps_through_the_text_decoder_give_the_wrappers_logits(engine):
    """Decode steps call the text decoder and lm_head directly (text_path.py) where, checked at load, the pair gives
    the model's own logits; a joining scenario run both ways gives the same tokens and logits (1e-6)."""
    assert engine.decoder.forward.text_path is not None
    requests = requests_for_join()

    def run(path):
        saved, engine.decoder.forward.text_path = engine.decoder.forward.text_path, path
        try:
            return cold_joins(engine, requests)
        finally:
            engine.decoder.forward.text_path = saved

    assert_same_runs(run(engine.decoder.forward.text_path), run(None))


def test_a_model_whose_forward_changes_the_logits_keeps_its_wrapper(engine, monkeypatch):
    """A family that rescales or caps its logits after lm_head (Gemma-style soft-capping, say) fails the load-time
    check, so its decode steps keep going through its own forward."""
    from inference_worker.engines.hf.text_path import text_path

    forward = engine.model.forward

    def capped_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits = 30.0 * torch.tanh(out.logits / 30.0) + 0.5
        return out
    monkeypatch.setattr(engine.model, "forward", capped_forward)
    assert text_path(engine.model, positions_kwarg=engine.decoder.forward.plain_positions) is None
    monkeypatch.setattr(engine.model, "forward", forward)
    assert text_path(engine.model, positions_kwarg=engine.decoder.forward.plain_positions) is not None
