"""What the engine hands the batch decoder for each request, and what it gets back: a prompt's inputs (made off
the model thread by the engine's `prepare`), one row of a decode, and a row's result.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from inference_worker.engines.hf.frame_cache import NOT_SEARCHED
from inference_worker.protocol import CacheLevel, SamplingParams

if TYPE_CHECKING:
    from inference_worker.engines.hf.frame_cache import FrameSignature  # noqa: F401


@dataclass
class FrameKey:
    """How a prompt's prefix is found in the FrameCache (see frame_cache.py)."""
    exact_key: bytes                 # preprocessed pixels + prefix token ids + model
    group_key: bytes                 # prefix token ids + image layout + model: who may stand in for whom
    signature: "FrameSignature"      # small thumbnails for the similar level
    #: FrameCache.nearest, found while preparing: (key, distance), None (searched, nothing close), or NOT_SEARCHED
    nearest: Any = NOT_SEARCHED


@dataclass
class PromptInputs:
    """A request's model inputs, made off the model thread by the engine's `prepare`."""
    prefix_ids: torch.Tensor         # (1, p): up to and including the last image token; p = 0 without images
    suffix_ids: torch.Tensor         # (1, s), s >= 1
    vision: dict[str, torch.Tensor]  # the processor's image tensors (pixel_values, ...), for the prefix
    num_images: int = 0
    frame: FrameKey | None = None    # None: no image, or reuse is off
    #: (1, p, hidden): the prefix as input embeddings, images already merged in; used instead of prefix_ids and
    #: `vision` for a cold prefill (the suffix is always token ids)
    prefix_embeds: torch.Tensor | None = None
    #: the request's compiled grammar (an llguidance matcher, made while preparing); each attempt decodes with a copy
    grammar: Any = None
    #: how an engine that encodes the images itself had their features (MiniCPM-o's vision cache); None: the
    #: decoder's frame KV decides the row's level
    cache_level: CacheLevel | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.prefix_ids.shape[1] + self.suffix_ids.shape[1])

    def all_ids(self) -> torch.Tensor:
        return torch.cat([self.prefix_ids, self.suffix_ids], dim=1)


@dataclass
class Row:
    """One request in a batch: its inputs, sampling, this attempt's grammar matcher (None = free text) and the
    event that says its client went away."""
    inputs: PromptInputs
    sampling: SamplingParams
    grammar: Any = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    on_token: Callable[[int], None] | None = None   # a streamed row: called with each token as it is chosen


@dataclass
class RowResult:
    token_ids: list[int]
    is_eos: bool
    prompt_tokens: int
    kv_cache: CacheLevel             # how much of the prompt came from the frame cache
    batch_size: int                  # the most rows decoded together while this row decoded (itself included)
    ttft_s: float                    # joining the decode to this row's first token
    decode_s: float                  # first token to last
    grammar_s: float = 0.0           # this row's share of the grammar's time
    vision_s: float = 0.0            # the model's image encoding in this row's prefill (0: a frame hit, no image)
    is_constrained: bool = False
    mean_live_rows: float = 1.0      # rows decoded together, on average over this row's steps
    logits: list[torch.Tensor] | None = None   # per step, kept only with `keep_logits` (tests)
