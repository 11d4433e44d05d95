"""Per-request sampling for transformers' generate, and how a generation ended. Shared by the engines."""

from __future__ import annotations

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
