"""Batched prefill of cold joiners on the tiny random MiniCPM-V 4.6 fixture (real transformers forward).

Why left padding is exact for its hybrid Qwen3.5 text model: the model zeroes padded inputs before a linear-attention
layer (`apply_mask_to_padding_states`, fed the 2-D mask by `create_recurrent_attention_mask`); its projections have
no bias, so a padded step has q = k = v = 0: the causal conv over leading zeros equals the zero initial conv state,
and the gated delta rule keeps a zero recurrent state at zero (decay * 0 + k * (v - 0) with k = 0). Full-attention
layers mask the padding; positions are explicit (cumsum(mask) - 1, the same for all M-RoPE sections). The tests
below check this on the states themselves, show the mask is what makes it exact, and then run the decoder: rows
prefilled together get their solo logits at every step.

Padding *between* a row's cached prefix and its suffix is not harmless (a padded step still applies the layer's
decay to a non-zero state): the decoder never builds it, and a test shows why.
"""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
from transformers import DynamicCache, MiniCPMV4_6ForConditionalGeneration

from inference_worker.engines.hf import cache_ops
from inference_worker.engines import EngineOptions, load_hf_engine
from inference_worker.engines.hf.packed_images import pack_image_inputs
from tests.fixtures.chat_requests import chat_request, png_bytes
from tests.fixtures.forward_spy import recording_forwards
from tests.test_continuous_batching import assert_same_logits

pytestmark = [pytest.mark.model]

KV_BYTES = 64 * 1024 * 1024
#: (question, colour, image size): prompts of five lengths, images of three shapes (8x8, 6x12, 12x6 patches: two
#: prefix lengths), rows 2 and 3 with one suffix length after prefixes of different lengths
ROWS = [("What is on this screen right now, exactly?", (220, 30, 30), (112, 112)),
        ("Which window has focus right now, and what does its title say?", (30, 160, 60), (224, 112)),
        ("List the buttons you see.", (30, 30, 220), (224, 112)),
        ("What is on this screen?", (200, 200, 30), (112, 112)),
        ("Describe it.", (30, 200, 200), (112, 224))]


@pytest.fixture(scope="module")
def engine(tiny_minicpmv46_dir):
    engine = load_hf_engine(str(tiny_minicpmv46_dir), EngineOptions(device="cpu", num_threads=1,
                                                                    kv_cache_bytes=KV_BYTES), progress=False)
    engine.decoder.keep_logits = True
    yield engine
    engine.close()


def prepared(engine, i: int, *, max_tokens: int = 12, is_kept: bool = False):
    question, color, size = ROWS[i]
    item = engine.prepare(chat_request(question, png_bytes(color, size), max_tokens=max_tokens, temperature=0)[0])
    if not is_kept:
        item.inputs.frame = None                     # reuse off for this row: nothing to keep
    return item


def inputs_of(engine, indices, **options):
    return [prepared(engine, i, **options).inputs for i in indices]


# ---------------------------------------------------------------- the model itself

def solo_forward(model, inputs):
    ids = inputs.all_ids()
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=torch.arange(ids.shape[1])[None],
                    cache=cache, use_cache=True, logits_to_keep=1, **inputs.vision)
    return cache, out.logits[0, -1]


def padded_forward(model, rows, *, is_masked: bool = True):
    prompts = [r.all_ids() for r in rows]
    longest = max(p.shape[1] for p in prompts)
    ids = prompts[0].new_full((len(rows), longest), int(prompts[0][0, -1]))
    mask = torch.zeros_like(ids)
    for i, prompt in enumerate(prompts):
        ids[i, longest - prompt.shape[1]:], mask[i, longest - prompt.shape[1]:] = prompt[0], 1
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask if is_masked else torch.ones_like(mask), position_ids=positions,
                    cache=cache, use_cache=True, logits_to_keep=1, **pack_image_inputs([r.vision for r in rows]))
    return cache_ops.split_rows(cache, [p.shape[1] for p in prompts]), out.logits[:, -1]


def state_gaps(row_cache, solo_cache) -> dict[str, float]:
    """The largest difference per kind of state: attention keys/values, conv and recurrent states."""
    gaps = {"kv": 0.0, "conv": 0.0, "recurrent": 0.0}
    for got, want in zip(row_cache.layers, solo_cache.layers):
        if type(want).__name__ == "DynamicLayer":
            assert got.keys.shape == want.keys.shape
            gaps["kv"] = max(gaps["kv"], (got.keys - want.keys).abs().max().item(),
                             (got.values - want.values).abs().max().item())
        else:
            gaps["conv"] = max(gaps["conv"], (got.conv_states[0] - want.conv_states[0]).abs().max().item())
            gaps["recurrent"] = max(gaps["recurrent"],
                                    (got.recurrent_states[0] - want.recurrent_states[0]).abs().max().item())
    return gaps


def variant(model, layer_types: list[str] | None = None, *, is_slow_decay: bool = False):
    """The fixture's model with another layer pattern (a full-attention layer before a linear one, as in the real
    3:1 pattern: padded queries of an attention layer then reach a linear layer), or with slowly decaying linear
    heads (the random fixture's decay forgets within a few tokens; a trained model's long-memory heads do not, and
    only then does a leak show in the final state)."""
    config = copy.deepcopy(model.config)
    if layer_types is not None:
        config.text_config.layer_types = layer_types
        config.text_config.num_hidden_layers = len(layer_types)
    torch.manual_seed(3)
    out = MiniCPMV4_6ForConditionalGeneration._from_config(config, attn_implementation="sdpa").eval()
    if layer_types is None:
        out.load_state_dict(model.state_dict())
    if is_slow_decay:
        with torch.no_grad():
            for name, parameter in out.named_parameters():
                if name.endswith("linear_attn.A_log"):
                    parameter.fill_(math.log(0.002))     # decay per step exp(-0.002 * softplus(a + dt_bias)) ~ 0.997
    return out


VARIANTS = {"fixture": {}, "full-first": {"layer_types": ["full_attention", "linear_attention", "linear_attention",
                                                          "full_attention"]},
            "slow-decay": {"is_slow_decay": True}}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(VARIANTS))
def test_left_padding_leaves_every_row_state_as_a_solo_prefill(engine, name):
    model = variant(engine.model, **VARIANTS[name]) if VARIANTS[name] else engine.model
    rows = inputs_of(engine, range(4))
    lengths = [r.num_tokens for r in rows]
    assert len(set(lengths)) == 4 and len({tuple(r.vision["target_sizes"][0].tolist()) for r in rows}) == 2
    caches, logits = padded_forward(model, rows)
    assert torch.isfinite(logits).all()
    for i, row in enumerate(rows):
        solo_cache, solo_logits = solo_forward(model, row)
        gaps = state_gaps(caches[i], solo_cache)
        assert max(gaps.values()) < 1e-5, (i, gaps)
        assert (logits[i] - solo_logits).abs().max().item() < 1e-5, i


def test_without_the_mask_the_padding_leaks_into_the_linear_states(engine):
    """The control: the same padded batch with an all-ones mask changes the shorter row's recurrent state (and,
    through the linear layer's output, the next layer's keys and values)."""
    model = variant(engine.model, is_slow_decay=True)
    rows = inputs_of(engine, range(3))
    caches, _ = padded_forward(model, rows, is_masked=False)
    shortest = min(range(3), key=lambda i: rows[i].num_tokens)
    solo_cache, _ = solo_forward(model, rows[shortest])
    gaps = state_gaps(caches[shortest], solo_cache)
    assert gaps["recurrent"] > 1e-4 and gaps["kv"] > 1e-3, gaps


def test_padding_between_a_cached_prefix_and_its_suffix_would_decay_the_recurrent_state(engine):
    """Why suffixes of different lengths never share a forward: zeroed inputs after a non-zero state still decay it."""
    row = inputs_of(engine, [0])[0]
    model, num_prefix = variant(engine.model, is_slow_decay=True), int(row.prefix_ids.shape[1])
    prefix = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=row.prefix_ids, attention_mask=torch.ones_like(row.prefix_ids),
              position_ids=torch.arange(num_prefix)[None], cache=prefix, use_cache=True, **row.vision)
    padded = torch.cat([row.suffix_ids[:, :1].repeat(1, 3), row.suffix_ids], dim=1)
    mask = torch.cat([torch.ones((1, num_prefix), dtype=torch.long), torch.zeros((1, 3), dtype=torch.long),
                      torch.ones_like(row.suffix_ids)], dim=1)
    positions = torch.cat([torch.zeros(3, dtype=torch.long), torch.arange(row.suffix_ids.shape[1])]) + num_prefix
    caches = []
    for ids, step_mask, step_positions in ((row.suffix_ids, None, None), (padded, mask, positions)):
        cache = copy.deepcopy(prefix)
        step_mask = torch.ones((1, num_prefix + ids.shape[1]), dtype=torch.long) if step_mask is None else step_mask
        step_positions = torch.arange(num_prefix, num_prefix + ids.shape[1]) if step_positions is None \
            else step_positions
        with torch.inference_mode():
            model(input_ids=ids, attention_mask=step_mask, position_ids=step_positions[None], cache=cache,
                  use_cache=True)
        caches.append(cache)
    linear = [i for i, layer in enumerate(prefix.layers) if type(layer).__name__ == "LinearAttentionLayer"]
    assert linear
    for i in linear:
        unpadded, padded_state = (c.layers[i].recurrent_states[0] for c in caches)
        assert (unpadded - padded_state).abs().max().item() > 1e-4


def test_packed_images_are_what_the_processor_makes_for_a_batch_of_prompts(engine):
    """pack_image_inputs over single prompts == the processor over the batch; and the vision tower over the packed
    batch gives each image the features it gets alone."""
    from PIL import Image
    import io

    images = [Image.open(io.BytesIO(png_bytes(color, size))).convert("RGB") for _, color, size in ROWS[:3]]
    text = "<|im_start|>user\n<|image_pad|>hi<|im_end|>\n<|im_start|>assistant\n"
    singles = [dict(engine.processor(text=[text], images=[[im]], return_tensors="pt")) for im in images]
    batch = dict(engine.processor(text=[text] * 3, images=[[im] for im in images], return_tensors="pt"))
    packed = pack_image_inputs([{k: s[k] for k in ("pixel_values", "target_sizes")} for s in singles])
    assert torch.equal(packed["pixel_values"], batch["pixel_values"])
    assert torch.equal(packed["target_sizes"], batch["target_sizes"])
    inner = engine.model.model
    with torch.inference_mode():
        together = inner.get_image_features(packed["pixel_values"], packed["target_sizes"]).pooler_output
        for i, single in enumerate(singles):
            alone = inner.get_image_features(single["pixel_values"], single["target_sizes"]).pooler_output
            assert torch.allclose(together[i], alone[0], atol=1e-5, rtol=0), i


# ---------------------------------------------------------------- the decoder

def solo(engine, item):
    results = []
    engine.decoder.run([engine.decoder_row(item)], lambda index, result: results.append(result))
    assert not isinstance(results[0], Exception), results[0]
    return results[0]


@contextlib.contextmanager
def counting_prefills(engine, *, failing_rows: int | None = None):
    """Records (batch rows, new tokens) of every multi-token forward (the model's, and the text path's: an
    exact hit's or a kept prefix's suffix); with `failing_rows`, a multi-token forward of that many rows fails."""
    calls = []

    def count(kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] > 1:
            calls.append(tuple(ids.shape))
            if ids.shape[0] == failing_rows:
                raise RuntimeError("a batched prefill that fails")
    with recording_forwards(engine, count):
        yield calls


def join(engine, items, join_at: dict[int, list[int]]):
    """Row 0 starts alone; at take_more call k the rows join_at[k] join together."""
    results, calls = {}, [0]

    def take_more(num_live):
        calls[0] += 1
        return [(i, engine.decoder_row(items[i])) for i in join_at.get(calls[0], [])]
    engine.decoder.run_indexed([(0, engine.decoder_row(items[0]))],
                               lambda index, result: results.__setitem__(index, result), take_more)
    return results


@pytest.mark.slow
def test_cold_joiners_prefilled_together_get_their_solo_logits_at_every_step(engine):
    """Rows 1-3 join together mid-decode (one 3-row prefill), row 4 joins later alone: all greedy, first-token and
    every step's logits within 1e-5 of each row decoded alone."""
    alone = [solo(engine, prepared(engine, i, max_tokens=16 if i == 0 else 10)) for i in range(5)]
    items = [prepared(engine, i, max_tokens=16 if i == 0 else 10) for i in range(5)]
    with counting_prefills(engine) as calls:
        results = join(engine, items, {2: [1, 2, 3], 5: [4]})
    for i in range(5):
        assert_same_logits(results[i], alone[i], f"row {i}")
        assert results[i].kv_cache == "off"
    assert [rows for rows, _ in calls] == [1, 3, 1]
    assert results[4].batch_size > 1                      # row 4 joined a running decode


@pytest.mark.slow
def test_joiners_whose_frames_are_kept_prefill_prefixes_together_then_equal_suffixes_together(engine):
    """With the FrameCache on, a miss keeps its frame's prefix state (for a hybrid cache: the state *after* the
    prefix). The joiners' prefixes go through one forward, the two suffixes of one length through one more, the
    other alone; logits equal the solo cold path, and each kept prefix serves an exact hit with the solo answer."""
    engine.frame_cache.clear()
    alone = [solo(engine, prepared(engine, i)) for i in range(4)]
    engine.frame_cache.clear()
    items = [prepared(engine, i, is_kept=True) for i in range(4)]
    suffixes = [int(item.inputs.suffix_ids.shape[1]) for item in items]
    assert suffixes[2] == suffixes[3] != suffixes[1]
    prefixes = [int(item.inputs.prefix_ids.shape[1]) for item in items]
    assert prefixes[2] != prefixes[3]                    # their merged prefixes are left-padded
    with counting_prefills(engine) as calls:
        results = join(engine, items, {2: [1, 2, 3]})
    for i in range(4):
        assert_same_logits(results[i], alone[i], f"row {i}")
        assert results[i].kv_cache == "miss"
    assert calls == [(1, prefixes[0]), (1, suffixes[0]),            # row 0 alone: prefix, then suffix
                     (3, max(prefixes[1:])), (1, suffixes[1]), (2, suffixes[2])]
    hits = {}
    for i in (1, 2, 3):
        hits[i] = solo(engine, prepared(engine, i, is_kept=True))
        assert hits[i].kv_cache == "exact"
        assert_same_logits(hits[i], alone[i], f"exact hit {i}")
    engine.frame_cache.clear()


@pytest.mark.slow
def test_an_exact_hit_joining_with_cold_rows_prefills_only_its_suffix_beside_their_group(engine):
    engine.frame_cache.clear()
    alone = [solo(engine, prepared(engine, i)) for i in range(4)]
    solo(engine, prepared(engine, 3, is_kept=True))          # row 3's frame is now cached
    items = [prepared(engine, i, is_kept=True) for i in range(4)]
    with counting_prefills(engine) as calls:
        results = join(engine, items, {2: [1, 2, 3]})
    prefixes = [int(item.inputs.prefix_ids.shape[1]) for item in items]
    suffixes = [int(item.inputs.suffix_ids.shape[1]) for item in items]
    assert calls == [(1, prefixes[0]), (1, suffixes[0]),
                     (2, max(prefixes[1:3])), (1, suffixes[1]), (1, suffixes[2]),   # rows 1, 2: one group
                     (1, suffixes[3])]                                             # row 3: its suffix only
    assert [results[i].kv_cache for i in range(4)] == ["miss", "miss", "miss", "exact"]
    for i in range(4):
        assert_same_logits(results[i], alone[i], f"row {i}")
    engine.frame_cache.clear()


@pytest.mark.slow
@pytest.mark.parametrize("is_kept", [False, True], ids=["reuse-off", "frame-kept"])
def test_a_failing_group_forward_leaves_its_rows_prefilled_alone(engine, is_kept):
    """reuse off: the 3-row whole-prompt forward fails. frame kept: the 3-row prefix forward succeeds and the 2-row
    suffix forward fails, so nothing of the group was kept yet: each row is prefilled (and its frame kept) alone."""
    engine.frame_cache.clear()
    alone = [solo(engine, prepared(engine, i)) for i in range(4)]
    items = [prepared(engine, i, is_kept=is_kept) for i in range(4)]
    with counting_prefills(engine, failing_rows=2 if is_kept else 3) as shapes:
        results = join(engine, items, {2: [1, 2, 3]})
    calls = [rows for rows, _ in shapes]
    group = [3, 1, 2] if is_kept else [3]                # kept: prefixes (3 rows), suffix of 47 alone, the pair fails
    per_row = [1, 1] if is_kept else [1]                 # each row alone: prefix then suffix, or the whole prompt
    assert calls == per_row + group + per_row * 3
    for i in range(4):
        assert_same_logits(results[i], alone[i], f"row {i}")
    if is_kept:
        assert engine.frame_cache.num_entries == 4
        for i in range(1, 4):
            hit = solo(engine, prepared(engine, i, is_kept=True))
            assert hit.kv_cache == "exact"
            assert_same_logits(hit, alone[i], f"exact hit {i}")
    engine.frame_cache.clear()


def test_rows_of_stacking_families_and_packed_ones_group_by_their_own_layout(engine):
    """MiniCPM-V rows with images of different shapes share one packed forward; a row without an image does not."""
    from inference_worker.engines.hf.packed_images import packed_image_layout

    assert engine.decoder.together is not None and engine.decoder.together.packs_images

    rows = inputs_of(engine, range(4))
    assert len({packed_image_layout(r.vision) for r in rows}) == 1
    text_only = engine.prepare(chat_request("Hello?", None, max_tokens=4)[0]).inputs
    assert packed_image_layout(text_only.vision) == ()
    assert packed_image_layout({"pixel_values": rows[0].vision["pixel_values"][0]}) is None


@pytest.mark.slow
def test_the_prefill_benchmark_runs_and_its_two_ways_agree(tmp_path):
    """benchmarks/prefill.py, cut short: every (family, reuse, rows) cell timed, and together == one by one."""
    import json

    from benchmarks import prefill

    out = tmp_path / "prefill.json"
    prefill.main(["--rows", "1,2", "--repeats", "1", "--json-out", str(out)])
    results = json.loads(out.read_text(encoding="utf-8"))["results"]
    assert {(r["family"], r["reuse"], r["rows"]) for r in results} == {
        (family, mode, rows) for family in prefill.FAMILIES for mode in prefill.MODES for rows in (1, 2)}
    for result in results:
        assert result["one_by_one_ms_per_row"] > 0 and result["together_ms_per_row"] > 0
        assert result["max_logit_gap"] < 1e-5, result
        assert result["rows_prefilled_together"] == (result["rows"] if result["rows"] > 1 else 0), result
