"""Batch-dimension operations on transformers caches, for a decode that rows join and leave.

A batched cache holds one row per request. Attention layers (`DynamicLayer`: keys/values of shape
(rows, heads, length, dim)) are aligned on the right: a shorter row is left-padded with zeros that the attention
mask hides. Linear-attention layers (`LinearAttentionLayer`, Qwen3.5's gated delta net: conv and recurrent
states of shape (rows, ...)) have no length: their per-row states are simply stacked. A row's states were
computed on that row alone, so stacking them changes nothing it computes (left padding never reaches a
recurrent state: each row was prefilled alone, and a one-token decode step holds no padding).

transformers 5.24's `LinearAttentionLayer` has no `batch_select_indices`; `select_rows` here covers both kinds.

`split_rows` is merge's inverse for a batched prefill: each row's own unpadded cache, cut from a left-padded
forward's cache (attention: the row's last `length` columns; linear attention: its row of the states, which a
left-padded prefill leaves exactly as a solo one: the model zeroes padded inputs, and zero input into a zero state
stays zero — see tests/test_batched_prefill.py).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

MERGEABLE_LAYERS = (DynamicLayer, LinearAttentionLayer)


def can_merge_layers(cache: DynamicCache) -> bool:
    """Whether every layer is one `merge` handles: plain attention (no sliding window, no index) or linear
    attention; hybrid layers that hold both, sliding windows and quantised layers are not."""
    return all(type(layer) in MERGEABLE_LAYERS for layer in cache.layers)


def merge(caches: Sequence[DynamicCache]) -> tuple[DynamicCache, torch.Tensor]:
    """One cache for the rows of `caches` (unpadded caches of one or more rows) and the attention mask
    (rows, length) that hides the left padding."""
    template = caches[0]
    layers = []
    for index, layer in enumerate(template.layers):
        parts = [cache.layers[index] for cache in caches]
        layers.append(_merge_attention(parts) if type(layer) is DynamicLayer else _merge_linear(parts))
    merged = DynamicCache()
    merged.layers = layers
    return merged, _mask_of(caches)


def append(batch: DynamicCache, mask: torch.Tensor,
           caches: Sequence[DynamicCache]) -> tuple[DynamicCache, torch.Tensor]:
    """`batch` (with its mask) followed by the rows of `caches`: the longer side sets the length, the other is
    left-padded. Returns the new cache and mask; `batch` is not used afterwards."""
    merged, _ = merge([batch, *caches])
    length = mask.shape[1]
    new_length = max([length, *(_seq_length(c) for c in caches)])
    rows = [torch.cat([mask.new_zeros((mask.shape[0], new_length - length)), mask], dim=1)]
    for cache in caches:
        rows.append(_single_mask(_seq_length(cache), new_length, _num_rows(cache), mask.device))
    return merged, torch.cat(rows, dim=0)


def select_rows(cache: DynamicCache, indices: torch.Tensor) -> None:
    """Keep only the rows `indices` (in that order), in place, in every layer."""
    for layer in cache.layers:
        if type(layer) is DynamicLayer:
            if layer.is_initialized and layer.keys.numel():
                layer.keys, layer.values = layer.keys[indices], layer.values[indices]
        else:
            _select_linear(layer, indices)


def split_rows(cache: DynamicCache, lengths: Sequence[int]) -> list[DynamicCache]:
    """One unpadded cache per row of `cache` (a left-padded batch whose row i holds `lengths[i]` real tokens at the
    right), each a copy: nothing is shared with `cache` or between rows."""
    rows = []
    for i, length in enumerate(lengths):
        row = DynamicCache()
        row.layers = [_attention_row(layer, i, length) if type(layer) is DynamicLayer else _linear_row(layer, i)
                      for layer in cache.layers]
        rows.append(row)
    return rows


def fork(cache: DynamicCache) -> DynamicCache:
    """A cache to extend without changing `cache` (a kept frame prefix): attention layers share its tensors, which
    a DynamicCache never writes into (it concatenates as it grows, as `prefix_of` relies on too); linear-attention
    layers get copies of their conv and recurrent states, which the model updates in place. What `copy.deepcopy`
    gave, without copying every key and value of the prefix for each reuse."""
    forked = DynamicCache()
    forked.layers = [_shared_attention(layer) if type(layer) is DynamicLayer else _linear_row(layer, slice(None))
                     for layer in cache.layers]
    return forked


def trim_left(cache: DynamicCache, mask: torch.Tensor) -> torch.Tensor:
    """Drop the leading columns that no row attends to (left padding of rows that left); returns the new mask."""
    attended = mask.any(dim=0)
    num_empty = int(torch.argmax(attended.to(torch.int8)).item()) if bool(attended.any()) else 0
    if num_empty == 0:
        return mask
    for layer in cache.layers:
        if type(layer) is DynamicLayer and layer.is_initialized and layer.keys.numel():
            layer.keys, layer.values = layer.keys[:, :, num_empty:], layer.values[:, :, num_empty:]
    return mask[:, num_empty:]


# ---------------------------------------------------------------- layers

def _merge_attention(parts: Sequence[DynamicLayer]) -> DynamicLayer:
    longest = max(_layer_length(p) for p in parts)
    keys = _left_pad_cat([p.keys for p in parts], longest)
    values = _left_pad_cat([p.values for p in parts], longest)
    layer = DynamicLayer()
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values
    return layer


def _merge_linear(parts: Sequence[LinearAttentionLayer]) -> LinearAttentionLayer:
    first = parts[0]
    layer = LinearAttentionLayer(number_of_states=first.number_of_states)
    layer.device, layer.dtype, layer.record_past = first.device, first.dtype, first.record_past
    for i in range(first.number_of_states):
        layer.conv_kernel_size[i] = first.conv_kernel_size[i]
        layer.has_previous_state[i] = all(p.has_previous_state[i] for p in parts)
        if all(p.is_conv_states_initialized[i] for p in parts):
            layer.conv_states[i] = torch.cat([p.conv_states[i] for p in parts], dim=0)
            layer.is_conv_states_initialized[i] = True
        if all(p.is_recurrent_states_initialized[i] for p in parts):
            layer.recurrent_states[i] = torch.cat([p.recurrent_states[i] for p in parts], dim=0)
            layer.is_recurrent_states_initialized[i] = True
    return layer


def _attention_row(layer: DynamicLayer, row: int, length: int) -> DynamicLayer:
    out = DynamicLayer()
    if layer.is_initialized and layer.keys.numel():
        keys = layer.keys[row:row + 1, :, layer.keys.shape[2] - length:].clone()
        values = layer.values[row:row + 1, :, layer.values.shape[2] - length:].clone()
        out.lazy_initialization(keys, values)
        out.keys, out.values = keys, values
    return out


def _shared_attention(layer: DynamicLayer) -> DynamicLayer:
    out = DynamicLayer()
    if layer.is_initialized:
        out.lazy_initialization(layer.keys, layer.values)
        out.keys, out.values = layer.keys, layer.values
    return out


def _linear_row(layer: LinearAttentionLayer, row: int | slice) -> LinearAttentionLayer:
    """A copy of one row of the layer's states (every row for `slice(None)`)."""
    out = LinearAttentionLayer(number_of_states=layer.number_of_states)
    out.device, out.dtype, out.record_past = layer.device, layer.dtype, layer.record_past
    for i in range(layer.number_of_states):
        out.conv_kernel_size[i] = layer.conv_kernel_size[i]
        out.has_previous_state[i] = layer.has_previous_state[i]
        if layer.is_conv_states_initialized[i]:
            out.conv_states[i] = _rows(layer.conv_states[i], row).clone()
            out.is_conv_states_initialized[i] = True
        if layer.is_recurrent_states_initialized[i]:
            out.recurrent_states[i] = _rows(layer.recurrent_states[i], row).clone()
            out.is_recurrent_states_initialized[i] = True
    return out


def _rows(states: torch.Tensor, row: int | slice) -> torch.Tensor:
    return states[row] if isinstance(row, slice) else states[row:row + 1]


def _select_linear(layer: Any, indices: torch.Tensor) -> None:
    for i in range(layer.number_of_states):
        if layer.is_conv_states_initialized[i]:
            layer.conv_states[i] = layer.conv_states[i][indices.to(layer.conv_states[i].device)]
        if layer.is_recurrent_states_initialized[i]:
            layer.recurrent_states[i] = layer.recurrent_states[i][indices.to(layer.recurrent_states[i].device)]


def _left_pad_cat(tensors: list[torch.Tensor], length: int) -> torch.Tensor:
    """(r_i, heads, len_i, dim) tensors -> (sum r_i, heads, length, dim), zeros on the left."""
    first = tensors[0]
    out = first.new_zeros((sum(t.shape[0] for t in tensors), first.shape[1], length, first.shape[3]))
    row = 0
    for tensor in tensors:
        out[row:row + tensor.shape[0], :, length - tensor.shape[2]:] = tensor
        row += tensor.shape[0]
    return out


def _layer_length(layer: DynamicLayer) -> int:
    return layer.keys.shape[2] if layer.is_initialized and layer.keys.numel() else 0


def _seq_length(cache: DynamicCache) -> int:
    return max((_layer_length(layer) for layer in cache.layers if type(layer) is DynamicLayer), default=0)


def _num_rows(cache: DynamicCache) -> int:
    for layer in cache.layers:
        if type(layer) is DynamicLayer and layer.is_initialized and layer.keys.numel():
            return layer.keys.shape[0]
        if type(layer) is not DynamicLayer and layer.is_recurrent_states_initialized.get(0):
            return layer.recurrent_states[0].shape[0]
    return 1


def _device_of(cache: DynamicCache) -> torch.device:
    for layer in cache.layers:
        if type(layer) is DynamicLayer and layer.is_initialized:
            return layer.keys.device
    return torch.device("cpu")


def _single_mask(length: int, total: int, num_rows: int, device) -> torch.Tensor:
    mask = torch.zeros((num_rows, total), dtype=torch.long, device=device)
    mask[:, total - length:] = 1
    return mask


def _mask_of(caches: Sequence[DynamicCache]) -> torch.Tensor:
    longest = max(_seq_length(c) for c in caches)
    device = _device_of(caches[0])
    return torch.cat([_single_mask(_seq_length(c), longest, _num_rows(c), device) for c in caches], dim=0)


def is_plain_attention(cache: DynamicCache) -> bool:
    """Whether every layer of the cache is a plain attention layer (keys and values only: no recurrent state)."""
    return all(type(layer) is DynamicLayer for layer in cache.layers)


def prefix_of(cache: DynamicCache, num_tokens: int) -> DynamicCache:
    """The first `num_tokens` positions of a plain attention cache, as a cache of its own. Views, not copies: a
    DynamicCache concatenates as it grows, so neither cache ever writes into the other's tensors."""
    return DynamicCache(ddp_cache_data=[(layer.keys[:, :, :num_tokens], layer.values[:, :, :num_tokens])
                                        for layer in cache.layers])
