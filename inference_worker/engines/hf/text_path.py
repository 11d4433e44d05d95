"""Decode steps (and text-only forwards) through the model's text decoder and lm_head, not the multimodal wrapper.

A decode step feeds one token per row and no image (nor does an exact frame hit's suffix), so the wrapper's
forward (Idefics3, LLaVA, MiniCPM-V: image merging, output capturing, keyword plumbing) only adds Python around the
same two calls: about a tenth of a tiny model's step on the CPU. The pair is used only where it gives the wrapper's
own logits, which `text_path` checks once at load on a short text-only prefill and decode (a family that rescales
or caps its logits fails the check and keeps the wrapper).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import DynamicCache

log = logging.getLogger("inference_worker")

#: how close the pair's logits must be to the wrapper's (float32, relative to the largest logit when above 1)
MAX_LOGIT_DIFFERENCE = 1e-4


class TextPath:
    """`decoder` (the text model: embeddings, layers, final norm) then `head` (lm_head) on the last position."""

    def __init__(self, decoder: Any, head: Any):
        self.decoder = decoder
        self.head = head

    def __call__(self, *, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: DynamicCache,
                 **positions: torch.Tensor) -> torch.Tensor:
        """The last position's logits, (rows, vocab), and the cache extended; call under inference_mode."""
        hidden = self.decoder(input_ids=input_ids, attention_mask=attention_mask, cache=cache, use_cache=True,
                              **positions).last_hidden_state
        return self.head(hidden[:, -1, :])


def text_path(model: Any, *, positions_kwarg: bool) -> TextPath | None:
    """The model's TextPath when its decoder and lm_head give the wrapper's logits on a short decode (two tokens,
    then two, then one), else None. `positions_kwarg`: the decoder is given position_ids (plain positions)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if decoder is None or head is None or decoder is model:
        return None
    path = TextPath(decoder, head)
    try:
        is_same = _gives_same_logits(model, path, positions_kwarg)
    except Exception:  # noqa: BLE001 - any model the check cannot run keeps its wrapper
        log.debug("the text-path check failed; decode steps go through the model's forward", exc_info=True)
        return None
    return path if is_same else None


def _gives_same_logits(model: Any, path: TextPath, positions_kwarg: bool) -> bool:
    """Two tokens through the model, then two more (a text-only forward after a cached prefix) and one more (a
    decode step), each through the model and through the path: the same logits?"""
    ids = torch.tensor([_plain_token_ids(model.config, 5)], device=model.device)
    logits: dict[bool, list[torch.Tensor]] = {}
    for use_path in (False, True):
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=ids[:, :2], attention_mask=torch.ones_like(ids[:, :2]), cache=cache, use_cache=True,
                  **_positions(0, 2, ids.device, positions_kwarg))
            for start, end in ((2, 4), (4, 5)):
                step = dict(input_ids=ids[:, start:end], attention_mask=torch.ones_like(ids[:, :end]), cache=cache,
                            **_positions(start, end, ids.device, positions_kwarg))
                out = path(**step) if use_path else model(**step, use_cache=True).logits[:, -1, :]
                logits.setdefault(use_path, []).append(out.float())
    return all(_is_close(a, b) for a, b in zip(logits[False], logits[True]))


def _is_close(wrapped: torch.Tensor, direct: torch.Tensor) -> bool:
    scale = max(1.0, float(wrapped.abs().max()))
    return wrapped.shape == direct.shape and bool((wrapped - direct).abs().max() <= MAX_LOGIT_DIFFERENCE * scale)


def _positions(start: int, end: int, device: torch.device, positions_kwarg: bool) -> dict[str, torch.Tensor]:
    return {"position_ids": torch.arange(start, end, device=device)[None]} if positions_kwarg else {}


def _plain_token_ids(config: Any, count: int) -> list[int]:
    """`count` token ids that are no image or video placeholder (the wrapper would look for their features)."""
    placeholders = {getattr(config, name, None) for name in ("image_token_id", "image_token_index", "video_token_id")}
    return [token for token in range(10, 10 + count + len(placeholders)) if token not in placeholders][:count]
