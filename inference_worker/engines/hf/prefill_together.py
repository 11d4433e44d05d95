"""Cold rows that join a decode together, prefilled in one forward: the decoder's batched prefill.

Rows without a frame hit whose image inputs share a layout (stacked along the batch for Idefics3/LLaVA, packed
patches for MiniCPM-V 4.6: packed_images.py) go through one left-padded forward (position_ids = cumsum(mask) - 1),
and each row's own unpadded cache is cut back out (cache_ops.split_rows). Left padding is exact for plain attention
and for linear-attention layers, which zero padded inputs before they reach their conv and recurrent states; it is
not exact *between* a cached prefix and its suffix (a padded step still decays the state), so a hybrid model whose
frame prefix must be kept prefills the prefixes together, then suffixes of equal length together.

Only rows whose prompt is one prefill piece (`RowPrefill.num_pieces`) join: a longer one is prefilled
alone, piece by piece, so that its cancellation is seen between pieces.

`BatchDecoder` (batch_decode.py) holds one `PrefillTogether` where the model allows it and calls its one method,
`prefill(rows)`; it works through the decoder's `RowPrefill` (frame lookups, kept prefixes, how many pieces a row
takes) and that one's `ModelForward` (the left-padded forward). A group whose forward fails leaves its rows to the
decoder, which prefills each alone (and each fails alone).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache

from inference_worker.engines.hf import cache_ops
from inference_worker.engines.hf.packed_images import pack_image_inputs, packed_image_layout
from inference_worker.engines.hf.row_prefill import RowPrefill, uncached_level
from inference_worker.protocol import CacheLevel

if TYPE_CHECKING:
    from inference_worker.engines.hf.rows import PromptInputs, Row

log = logging.getLogger("inference_worker")


class PrefillTogether:
    """The batch decoder's batched prefill (see the module docstring). `packs_images`: the model takes its prompts'
    images NaViT-packed (MiniCPM-V), else stacked along the batch."""

    def __init__(self, row_prefill: RowPrefill, *, packs_images: bool):
        self.row_prefill = row_prefill
        self.forward = row_prefill.forward
        self.packs_images = packs_images

    def prefill(self, rows: list[tuple[int, Row]]) -> dict[int, Any]:
        """Prefill, in one forward per group, the cold rows (no frame hit) whose image tensors have one layout.
        Returns {index: (the row's own cache, its first-token logits, its CacheLevel)} for those, and
        {index: its frame Lookup} for the rest (hits, rows given as embeddings, lone rows), which the decoder
        prefills alone; a group whose forward fails leaves its rows to be prefilled alone, each failing alone."""
        if len(rows) < 2:
            return {}
        groups: dict[tuple, list[tuple[int, Row, Any]]] = {}
        prefilled: dict[int, Any] = {}
        for index, row in rows:
            inputs = row.inputs
            prefilled[index] = found = self.row_prefill.lookup(inputs)
            layout = packed_image_layout(inputs.vision) if self.packs_images else _vision_layout(inputs)
            if (found is not None and found.value is not None) or layout is None or inputs.prefix_embeds is not None \
                    or self.row_prefill.num_pieces(inputs) > 1:     # a long prompt: prefilled alone, piece by piece
                continue
            groups.setdefault(layout, []).append((index, row, found))
        for group in (g for g in groups.values() if len(g) >= 2):
            try:
                prefilled.update(self._prefill_group(group))
            except Exception:  # noqa: BLE001 - each row of the group is tried alone, and fails alone
                log.debug("a batched prefill failed; its rows are prefilled one by one", exc_info=True)
        return prefilled

    def _prefill_group(self, group: list[tuple[int, Row, Any]],
                       ) -> dict[int, tuple[DynamicCache, torch.Tensor, CacheLevel]]:
        """The group's rows prefilled together, each row's unpadded cache and first-token logits, and each frame's
        prefix kept (after every forward succeeded: a failing group keeps nothing). Plain attention: one forward over
        the whole prompts, the prefix copied out of each row. A hybrid cache must keep the state *after the prefix*,
        which a whole-prompt forward never shows: the prefixes go through one forward, the suffixes of equal length
        through one more each (`_suffixes_together`); rows whose frame is not kept take the one-forward path."""
        inputs = [row.inputs for _, row, _ in group]
        is_kept = [found is not None for _, _, found in group]      # a frame miss: its prefix goes to the FrameCache
        if any(is_kept) and not cache_ops.is_plain_attention(self.forward.new_cache()):
            prefixes, _ = self.forward.prefill_rows([i.prefix_ids for i in inputs], self._combine_vision(inputs))
            caches, logits = self._suffixes_together(inputs, prefixes)
        else:
            caches, logits = self.forward.prefill_rows([i.all_ids() for i in inputs], self._combine_vision(inputs))
            prefixes = [cache_ops.prefix_of(cache, int(i.prefix_ids.shape[1])) if kept else None
                        for cache, i, kept in zip(caches, inputs, is_kept)]
        results = {}
        for (index, row, found), cache, row_logits, prefix in zip(group, caches, logits, prefixes):
            if found is not None:
                self.row_prefill.keep_prefix(row.inputs, prefix)
            level = found.level if found is not None else uncached_level(row.inputs)
            results[index] = (cache, row_logits, level)
        return results

    def _suffixes_together(self, inputs: list[PromptInputs], prefixes: list[DynamicCache],
                           ) -> tuple[list[DynamicCache], list[torch.Tensor]]:
        """Each row's suffix after its own prefix cache (left untouched, to be kept). Rows whose suffixes have one
        length go through one forward on their merged prefixes; a lone length goes alone. Suffixes of different
        lengths never share a forward: padding between a prefix and its suffix would decay a linear layer's state
        (a padded step still applies the layer's decay, and shifts its conv window)."""
        by_length: dict[int, list[int]] = {}
        for i, row in enumerate(inputs):
            by_length.setdefault(int(row.suffix_ids.shape[1]), []).append(i)
        caches: list[Any] = [None] * len(inputs)
        logits: list[Any] = [None] * len(inputs)
        for members in by_length.values():
            if len(members) == 1:
                i = members[0]
                caches[i], logits[i] = self.forward.prefill(cache_ops.fork(prefixes[i]), ids=inputs[i].suffix_ids,
                                                            num_past=int(inputs[i].prefix_ids.shape[1]))
                continue
            past = [prefixes[i] for i in members]                  # merged into new tensors: kept ones stay as is
            out_caches, out_logits = self.forward.prefill_rows(
                [inputs[i].suffix_ids for i in members], {}, past=past,
                num_past=[int(inputs[i].prefix_ids.shape[1]) for i in members])
            for i, cache, row_logits in zip(members, out_caches, out_logits):
                caches[i], logits[i] = cache, row_logits
        return caches, logits

    def _combine_vision(self, inputs: list[PromptInputs]) -> dict[str, torch.Tensor]:
        """The rows' image tensors as the model's batched forward takes them: NaViT-packed (MiniCPM-V) or stacked."""
        if self.packs_images:
            return pack_image_inputs([i.vision for i in inputs])
        return {key: torch.cat([i.vision[key] for i in inputs]) for key in inputs[0].vision}


def _vision_layout(inputs: PromptInputs) -> tuple | None:
    """What rows must share to stack their image tensors along the batch (names, shapes, dtypes); None when a
    value is not a batch-of-one tensor."""
    layout = []
    for key, value in sorted(inputs.vision.items()):
        if not torch.is_tensor(value) or value.ndim == 0 or value.shape[0] != 1:
            return None
        layout.append((key, tuple(value.shape), value.dtype))
    return tuple(layout)
