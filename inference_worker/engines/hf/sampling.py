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



#: top-p looks at this many of the most likely tokens first, then at more while they hold less than top_p of the
#: probability, and sorts the whole vocabulary only when the mass is spread that wide (random weights): sorting
#: all 248k logits costs ~20 ms a token on one core (benchmarks.sampling)
FIRST_CANDIDATES = 64
GROWTH = 8


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
        scores = torch.nan_to_num((logits.float() - logits.max()) / self.sampling.temperature, nan=0.0)
        values, ids = candidates(scores, top_k=self.sampling.top_k, top_p=self.sampling.top_p)
        picked = int(torch.multinomial(torch.softmax(values, dim=-1), 1, generator=self.generator))
        return picked if ids is None else int(ids[picked])


def candidates(scores: torch.Tensor, *, top_k: int = 0, top_p: float = 1.0
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The scores sampling draws from and their token ids (None: all of them, in order): the `top_k` best (0: no
    limit), then the fewest most likely whose probability reaches `top_p` (at least the best one). Only the
    candidates are sorted, never the whole vocabulary."""
    size = scores.shape[-1]
    top_k = min(top_k, size) if top_k else size
    if top_p >= 1.0:
        if top_k == size:
            return scores, None
        return torch.topk(scores, top_k)
    if top_k < size:
        values, ids = torch.topk(scores, top_k)
        return _nucleus(values, ids, torch.logsumexp(values, dim=-1), top_p)
    total = torch.logsumexp(scores, dim=-1)
    num_candidates = FIRST_CANDIDATES
    while num_candidates < size // GROWTH:
        values, ids = torch.topk(scores, num_candidates)
        mass = float(torch.exp(values - total).sum())
        if mass >= top_p:
            return _nucleus(values, ids, total, top_p)
        # no later token is likelier than these n, so k tokens hold at most mass * k / n: fewer cannot reach top_p
        num_candidates = max(num_candidates * GROWTH, int(num_candidates * top_p / max(mass, 1e-30)) + 1)
    values, ids = torch.sort(scores, descending=True)
    return _nucleus(values, ids, total, top_p)


def _nucleus(values: torch.Tensor, ids: torch.Tensor, total: torch.Tensor, top_p: float
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Of `values` (most likely first, `total` the log of all their probabilities' sum), the fewest whose
    probability reaches top_p, at least one (a top_p below float32's range reads as 0)."""
    probs = torch.exp(values - total)
    before = probs.cumsum(dim=-1) - probs
    num_kept = max(1, int((before < top_p).sum()))
    return values[:num_kept], ids[:num_kept]


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
