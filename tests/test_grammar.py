"""Grammar-constrained decoding (llguidance) on a tiny random Idefics3: a random model's output is valid
JSON of DeskEye's schema with the grammar, and is not without it."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from inference_worker.grammar import GrammarError, SchemaGrammars, unpack_bitmask
from inference_worker.engines.transformers_engine import load_transformers_engine
from inference_worker.protocol import DESKEYE_SCHEMA, ProtocolError
from tests.fixtures.chat_requests import chat_request, png_bytes, with_sampling

SCREEN = png_bytes((40, 160, 90))
NUM_SAMPLES = 7


@pytest.fixture(scope="module")
def constrained(tiny_idefics3_dir):
    engine = load_transformers_engine(str(tiny_idefics3_dir), device="cpu", num_threads=1, progress=False)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def unconstrained(tiny_idefics3_dir):
    """The same model with the grammar switched off: what the grammar is compared against."""
    engine = load_transformers_engine(str(tiny_idefics3_dir), device="cpu", num_threads=1, progress=False,
                                      use_grammar=False)
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


def test_every_constrained_generation_parses_and_validates(constrained):
    requests, images = deskeye_requests()
    answers = [constrained.complete(r, images) for r in requests]
    invalid = [a.text for a in answers if not is_valid(a.text)]
    assert not invalid
    assert {a.finish_reason for a in answers} == {"stop"}
    assert all(a.extra["constrained"] and a.extra["grammar_ms"] > 0 for a in answers)
    assert len({a.text for a in answers}) == len(answers)            # real, different samples
    assert constrained.grammars.num_compiled == 1                   # compiled once, a fresh matcher each time


def test_the_same_generations_without_the_grammar_fail_validation(unconstrained):
    requests, images = deskeye_requests()
    answers = [unconstrained.complete(r, images) for r in requests]
    assert not any(is_valid(a.text) for a in answers)
    assert not any(a.extra["constrained"] for a in answers)


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
        answer, free = constrained.complete(sampled, images), unconstrained.complete(sampled, images)
        assert answer.text.startswith('{"') and answer.extra["constrained"]
        assert answer.finish_reason == "length" and answer.completion_tokens == 40
        assert grammar_accepts(constrained.tokenizer, {"type": "object"}, answer.text)
        assert not grammar_accepts(constrained.tokenizer, {"type": "object"}, free.text)


def test_a_truncated_generation_reports_length_and_a_retry_with_more_tokens_validates(constrained):
    request, images = chat_request(image_png=SCREEN, deskeye_schema=True, max_tokens=6, temperature=1.0, seed=1)
    truncated = constrained.complete(request, images)
    assert truncated.finish_reason == "length" and truncated.completion_tokens == 6
    assert truncated.text.startswith('{"summary":"') and not is_valid(truncated.text)

    retried = constrained.complete(with_sampling(request, max_tokens=256, temperature=0.0), images)
    assert retried.finish_reason == "stop" and is_valid(retried.text)


def test_an_unusable_schema_is_a_request_error(constrained):
    request, images = chat_request(image_png=SCREEN, max_tokens=8, response_format={
        "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "strin"}}})
    with pytest.raises(GrammarError) as exc:
        constrained.complete(request, images)
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
