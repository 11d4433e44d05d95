"""One row's prompt into a cache of its own, reusing a frame's prefix KV where the FrameCache holds it.

A row's prompt is split after the last image token into a *prefix* (system prompt, earlier turns, image tokens) and a
*suffix* (the rest, up to the generation prompt). When this frame (exact) or a near-identical one (similar) was
prefilled before, the kept prefix KV is forked and only the suffix is prefilled; on a miss the whole prompt is
prefilled and its prefix kept. What happened is the row's `CacheLevel`.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

from inference_worker.engines.hf import cache_ops
from inference_worker.engines.hf.model_forward import ModelForward
from inference_worker.engines.hf.rows import PromptInputs
from inference_worker.protocol import CacheLevel

if TYPE_CHECKING:
    from inference_worker.engines.hf.frame_cache import FrameCache, Lookup


class RowPrefill:
    """Prefills one row at a time through `forward`, with frame reuse through `frame_cache` (None: off)."""

    def __init__(self, forward: ModelForward, frame_cache: "FrameCache | None" = None):
        self.forward = forward
        self.frame_cache = frame_cache

    def prefill(self, inputs: PromptInputs, found: "Lookup | None" = None, cancelled: threading.Event | None = None,
                ) -> tuple[DynamicCache, torch.Tensor, CacheLevel]:
        """This row's cache after its whole prompt, the logits for its first token, and what reuse happened.
        `found`: the row's FrameCache Lookup when it was made already (None: look it up here). RowCancelled once
        `cancelled` is set between two pieces of the prefill."""
        found = found if found is not None else self.lookup(inputs)
        if found is None:
            cache, logits = self._cold(inputs, cancelled)
            return cache, logits, uncached_level(inputs)
        if found.value is None:
            cache, logits, prefix_cache = self._prefill_and_keep_prefix(inputs, cancelled)
            self.keep_prefix(inputs, prefix_cache)
            return cache, logits, found.level
        cache, logits = self.forward.prefill(cache_ops.fork(found.value), ids=inputs.suffix_ids,
                                             num_past=int(inputs.prefix_ids.shape[1]), cancelled=cancelled)
        return cache, logits, found.level

    def lookup(self, inputs: PromptInputs) -> "Lookup | None":
        """The row's frame in the FrameCache, or None when reuse is off for it."""
        frame_cache, frame = self.frame_cache, inputs.frame
        if frame is None or frame_cache is None or frame_cache.max_bytes == 0:
            return None
        return frame_cache.lookup(frame.exact_key, frame.group_key, frame.signature, frame.nearest)

    def keep_prefix(self, inputs: PromptInputs, prefix_cache: DynamicCache) -> None:
        from inference_worker.engines.hf.frame_cache import tensor_nbytes
        frame = inputs.frame
        self.frame_cache.put(frame.exact_key, frame.group_key, frame.signature, prefix_cache,
                             tensor_nbytes(prefix_cache))

    def num_pieces(self, inputs: PromptInputs) -> int:
        """How many forwards the row's cold prefill takes alone (1: it may be prefilled with other rows)."""
        if inputs.prefix_embeds is not None:
            return len(self.forward.prefill_pieces(inputs.prefix_embeds)) + \
                len(self.forward.prefill_pieces(inputs.suffix_ids))
        return len(self.forward.prefill_pieces(inputs.all_ids(), inputs.vision))

    def _cold(self, inputs: PromptInputs, cancelled: threading.Event | None = None,
              ) -> tuple[DynamicCache, torch.Tensor]:
        forward = self.forward
        if inputs.prefix_embeds is None:
            return forward.prefill(forward.new_cache(), ids=inputs.all_ids(), vision=inputs.vision, num_past=0,
                                   cancelled=cancelled)
        cache, _ = forward.prefill(forward.new_cache(), embeds=inputs.prefix_embeds, num_past=0, cancelled=cancelled)
        return forward.prefill(cache, ids=inputs.suffix_ids, num_past=int(inputs.prefix_ids.shape[1]),
                               cancelled=cancelled)

    def _prefill_and_keep_prefix(self, inputs: PromptInputs, cancelled: threading.Event | None = None,
                                 ) -> tuple[DynamicCache, torch.Tensor, DynamicCache]:
        """A cold prefill that also yields the frame prefix's cache to keep. Plain attention caches are prefilled
        whole and the prefix copied out (one forward: the cold path itself); other caches (recurrent state
        cannot be cut) prefill the prefix, keep it, then the suffix on a fork of it."""
        forward, num_prefix = self.forward, int(inputs.prefix_ids.shape[1])
        if cache_ops.is_plain_attention(forward.new_cache()) and inputs.prefix_embeds is None:
            cache, logits = self._cold(inputs, cancelled)
            return cache, logits, cache_ops.prefix_of(cache, num_prefix)
        if inputs.prefix_embeds is not None:
            prefix_cache, _ = forward.prefill(forward.new_cache(), embeds=inputs.prefix_embeds, num_past=0,
                                              cancelled=cancelled)
        else:
            prefix_cache, _ = forward.prefill(forward.new_cache(), ids=inputs.prefix_ids, vision=inputs.vision,
                                              num_past=0, cancelled=cancelled)
        cache, logits = forward.prefill(cache_ops.fork(prefix_cache), ids=inputs.suffix_ids, num_past=num_prefix,
                                        cancelled=cancelled)
        return cache, logits, prefix_cache


def uncached_level(inputs: PromptInputs) -> CacheLevel:
    """The level of a row the FrameCache was not asked about: what the engine that encoded its images says
    (`inputs.cache_level`), else OFF for a row with images, NONE for one without."""
    if inputs.cache_level is not None:
        return inputs.cache_level
    return CacheLevel.OFF if inputs.num_images else CacheLevel.NONE

