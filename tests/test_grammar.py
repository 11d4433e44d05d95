"""Grammar-constrained decoding (llguidance) on a tiny random Idefics3: a random model's output is valid
JSON of DeskEye's schema with the grammar, and is not without it; and GrammarBatch, the batched decode loop's
grammar, driven step by step against a reference mask computed the slow, obvious way."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch

from inference_worker.engines.hf.grammar import GrammarError, SchemaGrammars
from inference_worker.engines.hf.grammar_batch import WORD_FILL_MIN_VOCAB, GrammarBatch, GrammarLogitsProcessor
from inference_worker.engines import EngineOptions, load_hf_engine
from inference_worker.engines.base import run_one
from inference_worker.protocol import ProtocolError
from deskeye.prompt import DESKEYE_SCHEMA
from inference_worker.engines.hf.token_mask import fill_banned_words, unpack_bitmask
from tests.fixtures.chat_requests import chat_request, png_bytes, with_sampling

pytestmark = [pytest.mark.model]

SCREEN = png_bytes((40, 160, 90))
NUM_SAMPLES = 7


@pytest.fixture(scope="module")
def constrained(tiny_idefics3_dir):
    engine = load_hf_engine(str(tiny_idefics3_dir), EngineOptions(device="cpu", num_threads=1), progress=False)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def unconstrained(tiny_idefics3_dir):
    """The same model with the grammar switched off: what the grammar is compared against."""
    engine = load_hf_engine(str(tiny_idefics3_dir), EngineOptions(device="cpu", num_threads=1, use_grammar=False),
                            progress=False)
    yield engine
    engine.close()


def deskeye_requests():
    request, images = chat_request(image_png=SCREEN, deskeye_schema=True, max_tokens=256)
    sampled = [with_sampling(request, temperature=1.0, top_p=0.95, top_k=50, seed=seed)   # the mask goes first
               for seed in range(NUM_SAMPLES)]
    return [request, *sampled], images


def is_valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), DESKEYE_SCHEMA)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


@pytest.mark.slow
def test_every_constrained_generation_parses_and_validates(constrained):
    requests, images = deskeye_requests()
    answers = [run_one(constrained, r) for r in requests]
    invalid = [a.text for a in answers if not is_valid(a.text)]
    assert not invalid
    assert {a.finish_reason for a in answers} == {"stop"}
    assert all(a.facts.constrained and a.facts.grammar_ms > 0 for a in answers)
    assert len({a.text for a in answers}) == len(answers)            # real, different samples
    assert constrained.grammars().num_compiled == 1                   # compiled once, a fresh matcher each time


@pytest.mark.slow
def test_the_same_generations_without_the_grammar_fail_validation(unconstrained):
    requests, images = deskeye_requests()
    answers = [run_one(unconstrained, r) for r in requests]
    assert not any(is_valid(a.text) for a in answers)
    assert not any(a.facts.constrained for a in answers)


def grammar_accepts(tokenizer, schema, text: str) -> bool:
    """An independent oracle: does a fresh llguidance matcher accept `text` as (a prefix of) `schema`'s JSON?"""
    import llguidance
    import llguidance.hf

    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer),
                                   llguidance.LLMatcher.grammar_from_json_schema(schema))
    return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and not matcher.is_error()


def test_json_object_output_follows_the_object_grammar(constrained, unconstrained):
    """A random model never closes an unbounded object (FIELD_NOTES), so this checks the output is an
    object's JSON so far and says "length"; the app's schema is bounded and does close (tests above)."""
    request, images = chat_request(image_png=SCREEN, max_tokens=40, response_format={"type": "json_object"})
    for seed in (3, 4, 5):
        sampled = with_sampling(request, temperature=1.0, seed=seed)
        answer, free = run_one(constrained, sampled), run_one(unconstrained, sampled)
        assert answer.text.startswith('{"') and answer.facts.constrained
        assert answer.finish_reason == "length" and answer.completion_tokens == 40
        assert grammar_accepts(constrained.tokenizer, {"type": "object"}, answer.text)
        assert not grammar_accepts(constrained.tokenizer, {"type": "object"}, free.text)


def test_a_truncated_generation_reports_length_and_a_retry_with_more_tokens_validates(constrained):
    request, images = chat_request(image_png=SCREEN, deskeye_schema=True, max_tokens=6, temperature=1.0, seed=1)
    truncated = run_one(constrained, request)
    assert truncated.finish_reason == "length" and truncated.completion_tokens == 6
    assert truncated.text.startswith('{"summary":"') and not is_valid(truncated.text)

    retried = run_one(constrained, with_sampling(request, max_tokens=256, temperature=0.0))
    assert retried.finish_reason == "stop" and is_valid(retried.text)


def test_an_unusable_schema_is_a_request_error(constrained):
    request, images = chat_request(image_png=SCREEN, max_tokens=8, response_format={
        "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "strin"}}})
    with pytest.raises(GrammarError) as exc:
        run_one(constrained, request)
    assert isinstance(exc.value, ProtocolError) and exc.value.param == "response_format"
    assert "strin" in str(exc.value)


def test_keywords_the_engine_lacks_are_ignored_and_whitespace_stays_strict(constrained):
    grammars = SchemaGrammars(constrained.tokenizer, vocab_size=len(constrained.tokenizer),
                              eos_token_ids=constrained.eos_token_ids)
    grammars.matcher({"type": "object", "properties": {"when": {"type": "string", "format": "hostname"}}})
    loose = grammars.matcher({"type": "object", "x-guidance": {"whitespace_flexible": True}})
    assert not loose.consume_tokens(constrained.tokenizer.encode('{ }', add_special_tokens=False))


def test_the_mask_pads_the_vocab_bans_special_tokens_and_ends_with_eos(constrained):
    tokenizer, eos = constrained.tokenizer, constrained.eos_token_ids[0]
    lm_head_size = constrained.model.get_output_embeddings().weight.shape[0]
    assert lm_head_size > len(tokenizer)                               # the fixture pads its vocab like Qwen
    grammars = SchemaGrammars(tokenizer, vocab_size=lm_head_size, eos_token_ids=[eos])
    processor = grammars.logits_processor(DESKEYE_SCHEMA)
    specials = [i for i in tokenizer.all_special_ids if i != eos]
    answer = tokenizer.encode('{"summary":"a red box","key_objects":["box"]}', add_special_tokens=False)

    generated = torch.empty(1, 0, dtype=torch.long)
    for token in [*answer, eos]:
        scores = processor(generated, torch.zeros(1, lm_head_size))
        allowed = torch.isfinite(scores[0])
        assert allowed[token], tokenizer.decode([token])
        assert not allowed[len(tokenizer):].any() and not allowed[specials].any()
        assert allowed[eos] == (token == eos)                        # EOS only once the JSON is complete
        generated = torch.cat([generated, torch.tensor([[token]])], dim=1)
    assert torch.isfinite(scores[0]).nonzero().flatten().tolist() == [eos]
    assert processor.is_complete()


def test_unpack_bitmask_reads_bit_31_and_pads_past_the_mask():
    bitmask = torch.tensor([[1 | (1 << 5) | -(1 << 31), 1 << 1]], dtype=torch.int32)   # tokens 0, 5, 31, 33
    allowed = unpack_bitmask(bitmask, 70)
    assert allowed.shape == (1, 70)
    assert allowed[0].nonzero().flatten().tolist() == [0, 5, 31, 33]


# ---------------------------------------------------------------- GrammarBatch: the decode loop's grammar

MAX_DECODE_STEPS = 1000
STRING_SCHEMA = {"type": "string", "pattern": "^[a-z ]{1,12}$"}
ARRAY_SCHEMA = {"type": "array", "items": {"type": "integer"}, "maxItems": 3}


@pytest.fixture(scope="module")
def grammars(constrained):
    """Grammars for the fixture's tokenizer and its padded lm_head (wider than the tokenizer, like Qwen's)."""
    lm_head_size = constrained.model.get_output_embeddings().weight.shape[0]
    grammars = SchemaGrammars(constrained.tokenizer, vocab_size=lm_head_size, eos_token_ids=constrained.eos_token_ids)
    yield grammars
    grammars.close()                                          # the prefetch thread


def test_the_allowed_words_ban_exactly_the_special_tokens_but_eos(constrained, grammars):
    allowed = unpack_bitmask(torch.from_numpy(grammars.allowed_words[None, :]), grammars.vocab_size)[0]
    banned = set((~allowed).nonzero().flatten().tolist())
    assert banned == set(grammars.banned_token_ids)
    tokenizer = constrained.tokenizer
    markers = ["<image>", "<row_1_col_1>", "<fake_token_around_image>", tokenizer.bos_token, tokenizer.pad_token]
    assert set(tokenizer.convert_tokens_to_ids(markers)) <= banned
    assert not banned & set(tokenizer.encode('{"summary": "a"}', add_special_tokens=False))
    assert grammars.eos_token_ids[0] not in banned
    eos_only = unpack_bitmask(torch.from_numpy(grammars.eos_only_words[None, :]), grammars.vocab_size)[0]
    assert eos_only.nonzero().flatten().tolist() == grammars.eos_token_ids[:1]


def reference_allowed(matcher, grammars: SchemaGrammars) -> set[int]:
    """What the first GrammarLogitsProcessor allowed, computed the slow, obvious way: the matcher's own bitmask
    read bit by bit, minus the special tokens; only the first EOS once the matcher has stopped."""
    eos = grammars.eos_token_ids[0]
    if matcher.is_stopped() or matcher.is_error():
        return {eos}
    bits = matcher.compute_bitmask()
    allowed = {8 * i + bit for i, byte in enumerate(bits) if byte for bit in range(8) if byte >> bit & 1}
    return allowed - set(grammars.banned_token_ids)


def finite_ids(logits_row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(logits_row).nonzero().flatten().tolist())


def greedy_decode(batch: GrammarBatch, schemas, *, vocab_size: int, eos: int, seed: int, on_step=None,
                  lazy: bool = False):
    """Greedy decode of random logits through `batch`, as the batched decode loop drives it: a constrained row
    leaves the step's rows once it samples EOS; unconstrained rows run until every constrained row is done.
    `lazy`: apply is told every row is greedy. `on_step(rows, raw_logits, masked_logits)` sees every step.
    Returns each row's sampled tokens."""
    generator = torch.Generator().manual_seed(seed)
    live = list(range(len(schemas)))
    tokens: dict[int, list[int]] = {row: [] for row in live}
    for _ in range(MAX_DECODE_STEPS):
        if all(schemas[row] is None for row in live):
            return tokens
        raw = torch.randn(len(live), vocab_size, generator=generator)
        logits = raw.clone()
        batch.apply(logits, live, greedy=[True] * len(live) if lazy else None)
        if on_step is not None:
            on_step(live, raw, logits)
        sampled = logits.argmax(-1)
        batch.advance(live, sampled)
        for row, token in zip(live, sampled.tolist()):
            tokens[row].append(token)
        live = [row for row, token in zip(live, sampled.tolist()) if schemas[row] is None or token != eos]
    raise AssertionError(f"the constrained rows did not finish in {MAX_DECODE_STEPS} steps")


@pytest.mark.parametrize("prefetch", [False, True], ids=["inline", "prefetch"])
def test_a_grammar_batch_decodes_constrained_rows_to_valid_json_and_leaves_free_rows_alone(constrained, grammars,
                                                                                         prefetch):
    tokenizer, eos = constrained.tokenizer, grammars.eos_token_ids[0]
    specials = set(grammars.banned_token_ids)
    assert specials and eos not in specials
    schemas = [DESKEYE_SCHEMA, None, DESKEYE_SCHEMA, DESKEYE_SCHEMA, None]
    batch = grammars.batch(schemas, prefetch=prefetch)
    num_eos_only_steps = []

    def check(rows, raw, masked):
        for position, row in enumerate(rows):
            if schemas[row] is None:
                assert torch.equal(masked[position], raw[position])        # bit for bit, nothing banned
                continue
            allowed = finite_ids(masked[position])
            assert allowed and not allowed & specials
            assert max(allowed) < len(tokenizer)                         # never the lm_head's padding
            if batch.matchers[row].is_stopped():
                assert allowed == {eos}                                   # complete: only EOS
                num_eos_only_steps.append(row)

    tokens = greedy_decode(batch, schemas, vocab_size=grammars.vocab_size, eos=eos, seed=11, on_step=check)
    for row in (0, 2, 3):
        assert tokens[row][-1] == eos and eos not in tokens[row][:-1]
        assert is_valid(tokenizer.decode(tokens[row][:-1])), tokenizer.decode(tokens[row])
        assert batch.is_accepting(row)
    assert sorted(num_eos_only_steps) == [0, 2, 3]                       # each row ended at its first chance
    assert len({tuple(tokens[row]) for row in (0, 2, 3)}) == 3            # rows have their own states
    assert not is_valid(tokenizer.decode(tokens[1])) and batch.is_accepting(1)
    assert batch.errors == [] and batch.elapsed_s > 0
    assert (batch.num_prefetched > 100) == prefetch and (batch.num_prefetched == 0) == (not prefetch)
    assert batch.elapsed_s_for(1) == 0 and batch.elapsed_s_for(0) > 0
    assert sum(batch.elapsed_s_for(row) for row in range(len(schemas))) == pytest.approx(batch.elapsed_s)


@pytest.mark.parametrize("prefetch", [False, True], ids=["inline", "prefetch"])
def test_grammar_batch_masks_equal_the_reference_masks_step_by_step(grammars, prefetch):
    """Every step of a batch of 8 (rows leaving as they finish), each row's allowed set equals the reference
    (the first processor's rule) for a fresh matcher fed the same tokens."""
    schemas = [DESKEYE_SCHEMA, STRING_SCHEMA, ARRAY_SCHEMA, None, DESKEYE_SCHEMA, STRING_SCHEMA, None, ARRAY_SCHEMA]
    references = [None if s is None else grammars.matcher(s) for s in schemas]
    num_compared = []

    def compare(rows, raw, masked):
        for row, line in zip(rows, masked):
            if references[row] is not None:
                assert finite_ids(line) == reference_allowed(references[row], grammars)
                references[row].consume_token(int(line.argmax()))      # the token the decode samples
                num_compared.append(row)

    greedy_decode(grammars.batch(schemas, prefetch=prefetch), schemas, vocab_size=grammars.vocab_size,
                  eos=grammars.eos_token_ids[0], seed=5, on_step=compare)
    assert all(r is None or r.is_stopped() for r in references)
    assert len(num_compared) > 50 and set(num_compared) == {0, 1, 2, 4, 5, 7}


def test_the_generate_adapter_masks_like_the_reference(constrained, grammars):
    schemas = [DESKEYE_SCHEMA, STRING_SCHEMA]
    processor = GrammarLogitsProcessor(grammars.batch(schemas))
    references = [grammars.matcher(s) for s in schemas]
    generated = torch.empty(2, 0, dtype=torch.long)
    generator = torch.Generator().manual_seed(3)
    for _ in range(40):
        raw = torch.randn(2, grammars.vocab_size, generator=generator)
        scores = processor(generated, raw)
        assert torch.isfinite(raw).all()                                 # out of place: generate keeps raw logits
        for row in range(2):
            assert finite_ids(scores[row]) == reference_allowed(references[row], grammars)
        sampled = scores.argmax(-1)
        for row, token in enumerate(sampled.tolist()):
            if not references[row].is_stopped():
                references[row].consume_token(token)
        generated = torch.cat([generated, sampled[:, None]], dim=1)
    assert processor.is_complete(1) and processor.errors == []


def test_apply_with_a_subset_of_rows_masks_each_line_for_its_row(grammars):
    width = grammars.vocab_size
    schemas = [STRING_SCHEMA, DESKEYE_SCHEMA, None, ARRAY_SCHEMA]
    batch = grammars.batch(schemas)
    references = [None if s is None else grammars.matcher(s) for s in schemas]

    def expect(rows):
        logits = torch.zeros(len(rows), width)
        batch.apply(logits, rows)
        for position, row in enumerate(rows):
            if references[row] is None:
                assert torch.equal(logits[position], torch.zeros(width))
            else:
                assert finite_ids(logits[position]) == reference_allowed(references[row], grammars)
        return logits

    first = expect([0, 1, 2, 3])
    assert len({frozenset(finite_ids(line)) for line in first[[0, 1, 3]]}) == 3   # three different masks
    tokens = [min(finite_ids(line)) if schemas[row] else 5 for row, line in enumerate(first)]
    batch.advance([0, 1, 2, 3], tokens)
    for row, token in enumerate(tokens):
        if references[row] is not None:
            assert references[row].consume_token(token)
    expect([0, 2, 3])                   # row 1 finished and left the batch
    expect([3, 0])                      # any order: line j is rows[j]
    expect([2])                         # only an unconstrained row: nothing to mask
    batch.advance([3], [min(reference_allowed(references[3], grammars))])
    references[3].consume_token(min(reference_allowed(references[3], grammars)))
    expect([0, 3, 1])                   # row 1 again, after row 3 moved on alone


def test_rows_join_and_leave_a_grammar_batch_and_a_freed_row_is_reused_with_its_own_mask(grammars):
    """Continuous batching: rows are added while others decode; a released row's line serves the next joiner
    from that joiner's own start, so a decode that never stops holds only as many lines as it had rows live."""
    width = grammars.vocab_size
    batch = grammars.batch([STRING_SCHEMA])
    first_mask = torch.zeros(1, width)
    batch.apply(first_mask, [0])
    token = min(finite_ids(first_mask[0]))
    batch.advance([0], [token])
    joiner = batch.add(grammars.matcher(ARRAY_SCHEMA))
    free = batch.add(None)
    assert (joiner, free) == (1, 2) and len(batch) == 3
    logits = torch.zeros(3, width)
    batch.apply(logits, [0, 1, 2])
    reference = grammars.matcher(STRING_SCHEMA)
    reference.consume_token(token)
    assert finite_ids(logits[0]) == reference_allowed(reference, grammars)
    assert finite_ids(logits[1]) == reference_allowed(grammars.matcher(ARRAY_SCHEMA), grammars)
    assert torch.equal(logits[2], torch.zeros(width))

    batch.release(0)
    reused = batch.add(grammars.matcher(DESKEYE_SCHEMA))
    assert reused == 0 and len(batch) == 3                       # the freed line, not a new one
    logits = torch.zeros(1, width)
    batch.apply(logits, [0])
    assert finite_ids(logits[0]) == reference_allowed(grammars.matcher(DESKEYE_SCHEMA), grammars)
    assert batch.elapsed_s_for(0) > 0


def test_a_refused_token_is_an_error_and_the_row_can_only_end(grammars):
    batch = grammars.batch([STRING_SCHEMA])
    logits = torch.zeros(1, grammars.vocab_size)
    batch.apply(logits, [0])
    refused = int(torch.isinf(logits[0]).nonzero()[0])
    batch.advance([0], torch.tensor([refused]))
    logits = torch.zeros(1, grammars.vocab_size)
    batch.apply(logits, [0])
    assert finite_ids(logits[0]) == {grammars.eos_token_ids[0]}
    assert len(batch.errors) == 1 and batch.errors[0].startswith("row 0: ")
    with pytest.raises(ValueError, match="2 tokens for 1 rows"):
        batch.advance([0], [1, 2])


def test_logits_wider_than_the_vocab_are_banned_in_constrained_rows_only(grammars):
    batch = grammars.batch([STRING_SCHEMA, None])
    logits = torch.zeros(2, grammars.vocab_size + 40)
    batch.apply(logits, [0, 1])
    assert torch.isinf(logits[0, grammars.vocab_size:]).all() and finite_ids(logits[0])
    assert torch.equal(logits[1], torch.zeros(grammars.vocab_size + 40))


def test_lazy_greedy_rows_pick_the_full_masks_argmax_and_skip_masks_for_accepted_argmaxes(grammars):
    """Two batches in lockstep on the same logits and tokens: one masks every row, the other is told which rows
    are greedy. Greedy rows must pick the same token; sampled rows must get the very same mask."""
    schemas = [DESKEYE_SCHEMA, STRING_SCHEMA, None, DESKEYE_SCHEMA, ARRAY_SCHEMA]
    greedy = [True, True, True, False, True]
    full, lazy = grammars.batch(schemas), grammars.batch(schemas)
    generator = torch.Generator().manual_seed(9)
    live, num_unmasked, num_masked, num_refused = list(range(len(schemas))), 0, 0, 0
    while any(schemas[row] is not None for row in live):
        raw = torch.randn(len(live), grammars.vocab_size, generator=generator)
        masked, lazily = raw.clone(), raw.clone()
        assert full.apply(masked, live) is None
        picked = lazy.apply(lazily, live, greedy=[greedy[row] for row in live])
        tokens = masked.argmax(-1).tolist()
        for line, row in enumerate(live):
            if not greedy[row]:
                assert torch.equal(lazily[line], masked[line])
            else:                                      # returned: the masked argmax, masked or not
                assert picked[line] == tokens[line]
            if greedy[row] and schemas[row] is not None:
                is_unmasked = torch.equal(lazily[line], raw[line])
                num_unmasked, num_masked = num_unmasked + is_unmasked, num_masked + (not is_unmasked)
                num_refused += picked[line] != raw[line].argmax().item()
        full.advance(live, tokens)
        lazy.advance(live, tokens)
        live = [row for row, token in zip(live, tokens) if schemas[row] is None or token != grammars.eos_token_ids[0]]
    assert num_unmasked > 10 and num_masked > 10        # random logits: the argmax is often refused, often not
    assert num_refused > num_masked                      # ... and then often a next-best token is allowed
    assert all(lazy.is_accepting(row) for row in range(len(schemas)))


def test_accepts_checks_a_token_without_a_mask(constrained, grammars):
    tokenizer, eos = constrained.tokenizer, grammars.eos_token_ids[0]
    batch = grammars.batch([STRING_SCHEMA, None])
    quote, letter = tokenizer.convert_tokens_to_ids('"'), tokenizer.convert_tokens_to_ids("a")
    assert batch.accepts(0, quote) and not batch.accepts(0, letter) and not batch.accepts(0, eos)
    assert batch.accepts(1, letter) and batch.accepts(1, grammars.banned_token_ids[0])     # unconstrained
    batch.advance([0], tokenizer.encode('"ab"', add_special_tokens=False)[:1])
    for token in tokenizer.encode('ab"', add_special_tokens=False):
        assert batch.accepts(0, token)
        batch.advance([0], [token])
    assert batch.accepts(0, eos) and not batch.accepts(0, letter)
    assert not batch.accepts(0, grammars.banned_token_ids[0])


def test_wide_cpu_logits_are_masked_a_word_at_a_time_like_the_reference(constrained):
    """An lm_head of WORD_FILL_MIN_VOCAB (the fixture's tokenizer, padded): apply takes fill_banned_words."""
    wide = SchemaGrammars(constrained.tokenizer, vocab_size=WORD_FILL_MIN_VOCAB,
                          eos_token_ids=constrained.eos_token_ids)
    assert wide.vocab_size % 32 == 0
    schemas = [STRING_SCHEMA, None, DESKEYE_SCHEMA]
    references = [None if s is None else wide.matcher(s) for s in schemas]

    def compare(rows, raw, masked):
        for row, raw_line, line in zip(rows, raw, masked):
            if references[row] is None:
                assert torch.equal(line, raw_line)
            else:
                assert finite_ids(line) == reference_allowed(references[row], wide)
                references[row].consume_token(int(line.argmax()))

    greedy_decode(wide.batch(schemas), schemas, vocab_size=wide.vocab_size, eos=wide.eos_token_ids[0], seed=2,
                  on_step=compare)
    assert all(r is None or r.is_stopped() for r in references)


def test_fill_banned_words_bans_exactly_the_set_bits():
    banned_words = np.array([[0, -1, -(1 << 31) | 1], [-(1 << 31), 0, 6]], dtype=np.int32)   # bit 31: sign
    logits = torch.arange(2 * 96, dtype=torch.float32).reshape(2, 96)
    fill_banned_words(logits, banned_words)
    assert torch.isinf(logits[0]).nonzero().flatten().tolist() == [*range(32, 64), 64, 95]
    assert torch.isinf(logits[1]).nonzero().flatten().tolist() == [31, 65, 66]
    assert logits[1, 0] == 96 and logits[0, 65] == 65                      # the rest untouched


def test_apply_masks_a_forwards_inference_tensor_in_or_out_of_inference_mode(grammars):
    batch = grammars.batch([STRING_SCHEMA])
    with torch.inference_mode():
        logits = torch.zeros(1, grammars.vocab_size)
        batch.apply(logits, [0])
        inside = finite_ids(logits[0])
        logits = torch.zeros(1, grammars.vocab_size)
    batch.apply(logits, [0])                      # the decode loop may mask outside inference_mode
    assert finite_ids(logits[0]) == inside == reference_allowed(grammars.matcher(STRING_SCHEMA), grammars)
