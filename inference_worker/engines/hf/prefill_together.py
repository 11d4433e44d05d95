"""Cold rows that join a decode together, prefilled in one forward: the decoder's batched prefill.

Rows without a frame hit whose image inputs share a layout (stacked along the batch for Idefics3/LLaVA, packed
patches for MiniCPM-V 4.6: packed_images.py) go through one left-padded forward (position_ids = cumsum(mask) - 1),
and each row's own unpadded cache is cut back out (cache_ops.split_rows). Left padding is exact for plain attention
and for linear-attention layers, which zero padded inputs before they reach their conv and recurrent states; it is
not exact *between* a cached prefix and its suffix (a padded step still decays the state), so a hybrid model whose
frame prefix must be kept prefills the prefixes together, then suffixes of equal length together.

Only rows whose prompt is one prefill piece (`BatchDecoder.num_prefill_pieces`) join: a longer one is prefilled
alone, piece by piece, so that its cancellation is seen between pieces.

`PrefillTogether` is mixed into `BatchDecoder` (batch_decode.py) and uses its `_forward`, `_new_cache`, `_lookup`,
`_keep_prefix`, `num_prefill_pieces`, `model`, `can_prefill_together` and `packs_images`. A group whose forward fails
leaves its rows to the decoder, which prefills each alone (and each fails alone).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache

from inference_worker.engines.hf import cache_ops
from inference_worker.engines.hf.packed_images import pack_image_inputs, packed_image_layout

if TYPE_CHECKING:
    from inference_worker.engines.hf.rows import PromptInputs, Row

log = logging.getLogger("deskeye.worker")


class PrefillTogether:
    """The batched-prefill half of BatchDecoder (see the module docstring)."""

    def _prefill_cold_together(self, rows: list[tuple[int, Row]]) -> dict[int, Any]:
        """Prefill, in one forward per group, the cold rows (no frame hit) whose image tensors have one layout.
        Returns {index: (the row's own cache, its first-token logits, its kv_cache level)} for those, and
        {index: its frame Lookup} for the rest (hits, rows given as embeddings, lone rows), which `_start_row`
        prefills alone; a group whose forward fails leaves its rows to be prefilled alone, each failing alone."""
        if not self.can_prefill_together or len(rows) < 2:
            return {}
        groups: dict[tuple, list[tuple[int, Row, Any]]] = {}
        prefilled: dict[int, Any] = {}
        for index, row in rows:
            inputs = row.inputs
            prefilled[index] = found = self._lookup(inputs)
            layout = packed_image_layout(inputs.vision) if self.packs_images else _vision_layout(inputs)
            if (found is not None and found.value is not None) or layout is None or inputs.prefix_embeds is not None \
                    or self.num_prefill_pieces(inputs) > 1:     # a long prompt: prefilled alone, piece by piece
                continue
            groups.setdefault(layout, []).append((index, row, found))
        for group in (g for g in groups.values() if len(g) >= 2):
            try:
                prefilled.update(self._prefill_group(group))
            except Exception:  # noqa: BLE001 - each row of the group is tried alone, and fails alone
                log.debug("a batched prefill failed; its rows are prefilled one by one", exc_info=True)
        return prefilled

    def _prefill_group(self, group: list[tuple[int, Row, Any]]) -> dict[int, tuple[DynamicCache, torch.Tensor, str]]:
        """The group's rows prefilled together, each row's unpadded cache and first-token logits, and each frame's
        prefix kept (after every forward succeeded: a failing group keeps nothing). Plain attention: one forward over
        the whole prompts, the prefix copied out of each row. A hybrid cache must keep the state *after the prefix*,
        which a whole-prompt forward never shows: the prefixes go through one forward, the suffixes of equal length
        through one more each (`_suffixes_together`); rows whose frame is not kept take the one-forward path."""
        inputs = [row.inputs for _, row, _ in group]
        is_kept = [found is not None for _, _, found in group]      # a frame miss: its prefix goes to the FrameCache
        if any(is_kept) and not cache_ops.is_plain_attention(self._new_cache()):
            prefixes, _ = self._forward_rows([i.prefix_ids for i in inputs], self._combine_vision(inputs))
            caches, logits = self._suffixes_together(inputs, prefixes)
        else:
            caches, logits = self._forward_rows([i.all_ids() for i in inputs], self._combine_vision(inputs))
            prefixes = [cache_ops.prefix_of(cache, int(i.prefix_ids.shape[1])) if kept else None
                        for cache, i, kept in zip(caches, inputs, is_kept)]
        results = {}
        for (index, row, found), cache, row_logits, prefix in zip(group, caches, logits, prefixes):
            if found is not None:
                self._keep_prefix(row.inputs, prefix)
            level = found.level if found is not None else ("off" if row.inputs.num_images else "none")
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
                caches[i], logits[i] = self._forward(cache_ops.fork(prefixes[i]), ids=inputs[i].suffix_ids,
                                                     num_past=int(inputs[i].prefix_ids.shape[1]))
                continue
            past = [prefixes[i] for i in members]                  # merged into new tensors: kept ones stay as is
            out_caches, out_logits = self._forward_rows([inputs[i].suffix_ids for i in members], {}, past=past,
                                                        num_past=[int(inputs[i].prefix_ids.shape[1]) for i in members])
            for i, cache, row_logits in zip(members, out_caches, out_logits):
                caches[i], logits[i] = cache, row_logits
        return caches, logits

    def _forward_rows(self, ids: list[torch.Tensor], vision: dict[str, torch.Tensor], *,
                      past: list[DynamicCache] | None = None, num_past: list[int] | None = None,
                      ) -> tuple[list[DynamicCache], torch.Tensor]:
        """One forward over several rows' new tokens (each (1, n_i)), left-padded (position_ids = num_past +
        cumsum(mask) - 1), from an empty cache or on the rows' `past` caches (merged; then every row adds equally
        many tokens, so no padding sits between a row's past and its new tokens). Returns each row's unpadded cache
        (cache_ops.split_rows) and its last logits (rows, vocab)."""
        lengths = [int(t.shape[1]) for t in ids]
        longest = max(lengths)
        num_past = num_past or [0] * len(ids)
        batch_ids = ids[0].new_full((len(ids), longest), self._filler_token(ids[0]))
        new_mask = torch.zeros_like(batch_ids)
        for i, row in enumerate(ids):
            batch_ids[i, longest - lengths[i]:] = row[0]
            new_mask[i, longest - lengths[i]:] = 1
        if past is None:
            cache, mask = self._new_cache(), new_mask
        else:
            if len(set(lengths)) > 1:
                raise ValueError(f"rows on past caches must add equally many tokens; got {lengths}")
            cache, past_mask = cache_ops.merge(past)
            mask = torch.cat([past_mask, new_mask], dim=1)
        positions = torch.tensor(num_past, device=new_mask.device)[:, None] + (new_mask.cumsum(dim=1) - 1).clamp(min=0)
        with torch.inference_mode():
            out = self.model(input_ids=batch_ids, attention_mask=mask, position_ids=positions, cache=cache,
                             use_cache=True, logits_to_keep=1, **vision)
        totals = [p + n for p, n in zip(num_past, lengths)]
        return cache_ops.split_rows(cache, totals), out.logits[:, -1, :]

    def _filler_token(self, ids: torch.Tensor) -> int:
        """A token for the padding (masked out, so any real one), but never an image or video placeholder: the model
        counts those to place the image features (a prefix ends on one)."""
        config = self.model.config
        placeholders = {getattr(config, name, None) for name in ("image_token_id", "image_token_index",
                                                                 "video_token_id")}
        return next((token for token in ids[0].tolist() if token not in placeholders), int(ids[0, 0]))

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
