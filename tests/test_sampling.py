"""Sampling over a real vocabulary: top-p looks only at the most likely tokens, yet keeps exactly the set a full
sort keeps, for peaked and flat logits, with and without top-k; seeded draws repeat."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from inference_worker.engines.hf.sampling import FIRST_CANDIDATES, TokenSampler, candidates  # noqa: E402
from inference_worker.protocol import SamplingParams  # noqa: E402

REAL_VOCAB = 248_094      # MiniCPM-V 4.6's output head


#: float32 sums over 248k probabilities: a token whose preceding mass is this close to top_p may go either way
BOUNDARY = 1e-5


def sorted_reference(scores: torch.Tensor, top_k: int, top_p: float) -> tuple[set[int], set[int]]:
    """The definition, by sorting everything in float64: the top_k best, then the fewest of them whose softmax
    reaches top_p; and the tokens at the boundary (their preceding mass within BOUNDARY of top_p)."""
    order = torch.sort(scores.double(), descending=True)
    values, ids = order.values, order.indices
    if top_k:
        values, ids = values[:top_k], ids[:top_k]
    probs = torch.softmax(values, dim=-1)
    before = probs.cumsum(dim=-1) - probs
    num_kept = max(1, int((before < top_p).sum()))
    return set(ids[:num_kept].tolist()), set(ids[(before - top_p).abs() < BOUNDARY].tolist())


def kept(scores: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    values, ids = candidates(scores, top_k=top_k, top_p=top_p)
    assert values.shape == ids.shape
    assert torch.equal(values, scores[ids])                                  # each id carries its own score
    return set(ids.tolist())


def logits(kind: str, size: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randn(size, generator=generator, dtype=torch.float64)
    # peaked: a trained model's next token (a few hold most of the mass); wide: top_p needs thousands of
    # candidates (the search grows); flat: random weights (mass spread over the whole vocabulary: a full sort)
    return (raw * {"peaked": 6.0, "wide": 2.5, "flat": 0.05}[kind]).float()


@pytest.mark.parametrize("kind", ["peaked", "wide", "flat"])
@pytest.mark.parametrize("top_k,top_p", [(0, 0.9), (0, 0.5), (0, 0.999), (50, 0.9), (2_000, 0.95), (0, 1e-30)])
def test_top_p_keeps_what_a_full_sort_keeps_at_real_vocabulary_size(kind, top_k, top_p):
    for seed in range(3):
        scores = logits(kind, REAL_VOCAB, seed)
        got = kept(scores, top_k, top_p)
        expected, boundary = sorted_reference(scores, top_k, top_p)
        assert got ^ expected <= boundary, (kind, top_k, top_p, seed, len(got), len(expected))
        differing = torch.tensor(sorted(got ^ expected), dtype=torch.long)
        assert float(torch.softmax(scores.double(), dim=-1)[differing].sum()) < BOUNDARY     # what they weigh


def test_the_candidates_grow_past_the_first_look_when_the_mass_is_spread():
    scores = logits("flat", REAL_VOCAB, 0)
    values, _ = candidates(scores, top_p=0.9)
    assert len(values) > 100 * FIRST_CANDIDATES                  # ~90 % of a flat vocabulary
    values, _ = candidates(logits("peaked", REAL_VOCAB, 0), top_p=0.9)
    assert len(values) < REAL_VOCAB // 100


def test_top_k_alone_and_no_limit():
    scores = logits("peaked", 1_000, 1)
    values, ids = candidates(scores, top_k=7)
    assert set(ids.tolist()) == set(torch.topk(scores, 7).indices.tolist())
    values, ids = candidates(scores)
    assert ids is None and values is scores


def test_masked_tokens_are_never_drawn_and_a_seed_repeats_its_draws():
    scores = logits("flat", REAL_VOCAB, 2)
    allowed = torch.zeros(REAL_VOCAB, dtype=torch.bool)
    allowed[torch.arange(0, REAL_VOCAB, 997)] = True                 # what a grammar allows: 249 tokens
    masked = scores.masked_fill(~allowed, float("-inf"))
    for top_k, top_p in [(0, 1.0), (0, 0.9), (40, 0.95), (0, 0.999999)]:
        params = SamplingParams(temperature=1.0, top_p=top_p, top_k=top_k, seed=11)
        first = [TokenSampler(params).sample(masked) for _ in range(2)]
        sampler = TokenSampler(params)
        draws = [sampler.sample(masked) for _ in range(200)]
        assert all(allowed[token] for token in draws), (top_k, top_p)
        assert first[0] == first[1] == draws[0]
        assert len(set(draws)) > 20                                          # a draw, not the argmax


def test_draws_follow_the_probabilities():
    """5 tokens with known probabilities, top_p 0.7 keeps the best two (0.4 + 0.3): drawn ~4:3, the rest never."""
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    sampler = TokenSampler(SamplingParams(temperature=1.0, top_p=0.7, seed=3))
    draws = [sampler.sample(probs.log()) for _ in range(4_000)]
    counts = [draws.count(i) for i in range(5)]
    assert counts[2:] == [0, 0, 0], counts
    assert abs(counts[0] / 4_000 - 0.4 / 0.7) < 0.03, counts
