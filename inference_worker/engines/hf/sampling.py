"""Per-request sampling for transformers' generate, and how a generation ended. Shared by the engines."""

from __future__ import annotations

import secrets
from typing import Any, Iterable, Sequence

import torch

from inference_worker.protocol import SamplingParams


def generate_kwargs(sampling: SamplingParams) -> dict[str, Any]:
    """generate() keywords for one request: temperature 0 is greedy; top_k 0 and top_p 1 are off.

    Every knob is passed explicitly so a checkpoint's generation_config.json (often temperature 0.7,
    top_p 0.8, repetition_penalty 1.05, or beams) cannot change what the request asked for.
    """
    common = {"max_new_tokens": sampling.max_tokens, "num_beams": 1, "repetition_penalty": 1.0}
    if sampling.is_greedy:
        return {**common, "do_sample": False, "temperature": 1.0, "top_p": 1.0, "top_k": None}
    return {**common, "do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p,
            "top_k": sampling.top_k or None}


def argmax_lines(logits: torch.Tensor) -> list[int]:
    """Each line's argmax (the first, on ties). On the CPU through numpy: torch's CPU argmax is 2.5x (832
    tokens) to 25x (150k tokens) slower with one thread."""
    if logits.is_cpu and logits.dtype in (torch.float32, torch.float64, torch.float16):
        return logits.detach().numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()



class TokenSampler:
    """Picks one row's next token from its logits: argmax when greedy, else temperature, top-k and top-p, drawn
    from the row's own generator (seeded from the request), so a seeded request samples the same tokens
    whether it runs alone or batched with others."""

    def __init__(self, sampling: SamplingParams, device: torch.device | str = "cpu"):
        self.sampling = sampling
        self.generator = None
        if not sampling.is_greedy:
            self.generator = torch.Generator(device=device)
            seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
            self.generator.manual_seed(seed)

    @property
    def is_greedy(self) -> bool:
        return self.generator is None

    def sample(self, logits: torch.Tensor) -> int:
        """`logits`: (vocab,) float, already masked (-inf = not allowed)."""
        if self.generator is None:
            return int(torch.argmax(logits))
        if not torch.isfinite(logits.max()):           # nan from the model, or nothing allowed: the best it has
            return int(torch.argmax(torch.nan_to_num(logits, nan=float("-inf"))))
        # shifted so the best token scores 0: a temperature too small for the dtype (1e-300 is 0 in float32) then
        # sends the others to -inf and leaves the best at 0/0, read as 0 (its limit), never nan in the softmax
        scores = torch.nan_to_num((logits - logits.max()) / self.sampling.temperature, nan=0.0)
        if self.sampling.top_k:
            kth = torch.topk(scores, min(self.sampling.top_k, scores.shape[-1])).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.sampling.top_p < 1.0:
            scores = _top_p(scores, self.sampling.top_p)
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def _top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches top_p (at least one)."""
    sorted_scores, order = torch.sort(scores, descending=True)
    cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
    drop_sorted = cumulative - torch.softmax(sorted_scores, dim=-1) >= top_p
    drop_sorted[0] = False          # the best token always stays (a top_p below float32's range reads as 0)
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return scores.masked_fill(drop, float("-inf"))


def seed_generation(sampling: SamplingParams) -> None:
    """Seed torch's generators (CPU and CUDA) so the same seed gives the same sample on the model thread."""
    if sampling.seed is not None:
        torch.manual_seed(sampling.seed)


def eos_token_ids(generation_config: Any, tokenizer: Any) -> list[int]:
    """The ids that end a generation: generation_config's eos_token_id (int or list), else the tokenizer's."""
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    return [int(i) for i in ids]


def trim_at_eos(token_ids: Sequence[int], eos_ids: Iterable[int]) -> tuple[list[int], bool]:
    """Generated ids up to and including the first EOS, and whether an EOS was produced."""
    eos = set(eos_ids)
    for i, token_id in enumerate(token_ids):
        if token_id in eos:
            return list(token_ids[: i + 1]), True
    return list(token_ids), False


def finish_reason(is_eos: bool) -> str:
    return "stop" if is_eos else "length"
