"""Batch-dimension cache operations on real caches of the tiny MiniCPM-V 4.6 text model (one linear-attention layer
with conv and recurrent state, one full-attention layer): rows merge with left padding, leave (the linear layer's
missing batch_select_indices included), and the padding nobody attends to any more is trimmed."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText, DynamicCache
from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

from inference_worker.engines.hf import cache_ops

pytestmark = [pytest.mark.model]

LENGTHS = (5, 9, 3)


@pytest.fixture(scope="module")
def row_caches(tiny_minicpmv46_dir):
    model = AutoModelForImageTextToText.from_pretrained(tiny_minicpmv46_dir, dtype=torch.float32).eval()
    caches = []
    for length in LENGTHS:
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=torch.arange(10, 10 + length).unsqueeze(0), cache=cache, use_cache=True)
        caches.append(cache)
    return caches


def layers_of(cache):
    attention = next(layer for layer in cache.layers if type(layer) is DynamicLayer)
    linear = next(layer for layer in cache.layers if type(layer) is LinearAttentionLayer)
    return attention, linear


def test_rows_merge_left_padded_and_their_linear_states_stack(row_caches):
    assert all(cache_ops.can_merge_layers(c) for c in row_caches)
    merged, mask = cache_ops.merge(row_caches)
    assert mask.tolist() == [[0] * (9 - n) + [1] * n for n in LENGTHS]
    attention, linear = layers_of(merged)
    for row, (cache, length) in enumerate(zip(row_caches, LENGTHS)):
        alone_attention, alone_linear = layers_of(cache)
        assert torch.equal(attention.keys[row, :, 9 - length:], alone_attention.keys[0])
        assert not attention.keys[row, :, :9 - length].any()
        assert torch.equal(linear.recurrent_states[0][row], alone_linear.recurrent_states[0][0])
        assert torch.equal(linear.conv_states[0][row], alone_linear.conv_states[0][0])


def test_rows_leave_and_the_unattended_padding_is_trimmed(row_caches):
    merged, mask = cache_ops.merge(row_caches)
    keep = torch.tensor([0, 2])                                  # the longest row (9 tokens) leaves
    cache_ops.select_rows(merged, keep)
    mask = cache_ops.trim_left(merged, mask[keep])
    attention, linear = layers_of(merged)
    assert mask.tolist() == [[1] * 5, [0, 0, 1, 1, 1]]            # 4 columns nobody attends to: gone
    assert attention.keys.shape[:3] == (2, attention.keys.shape[1], 5)
    assert torch.equal(linear.recurrent_states[0][1], layers_of(row_caches[2])[1].recurrent_states[0][0])


def test_a_joiner_appends_to_a_running_batch_on_whichever_side_is_longer(row_caches):
    running, mask = cache_ops.merge([row_caches[0], row_caches[2]])          # length 5
    merged, mask = cache_ops.append(running, mask, [row_caches[1]])          # a 9-token joiner: the batch pads
    assert mask.tolist() == [[0, 0, 0, 0, 1, 1, 1, 1, 1], [0] * 6 + [1] * 3, [1] * 9]
    attention, linear = layers_of(merged)
    assert torch.equal(attention.keys[2], layers_of(row_caches[1])[0].keys[0])
    assert linear.recurrent_states[0].shape[0] == 3


def test_split_rows_gives_back_each_row_unpadded_and_unshared(row_caches):
    """merge's inverse (what a batched prefill uses): every row's own cache, equal to the one merged, a copy."""
    merged, _ = cache_ops.merge(row_caches)
    rows = cache_ops.split_rows(merged, LENGTHS)
    assert len(rows) == len(LENGTHS)
    for row, alone in zip(rows, row_caches):
        (attention, linear), (alone_attention, alone_linear) = layers_of(row), layers_of(alone)
        assert torch.equal(attention.keys, alone_attention.keys)
        assert torch.equal(attention.values, alone_attention.values)
        assert torch.equal(linear.conv_states[0], alone_linear.conv_states[0])
        assert torch.equal(linear.recurrent_states[0], alone_linear.recurrent_states[0])
        assert linear.has_previous_state[0] and linear.conv_kernel_size[0] == alone_linear.conv_kernel_size[0]
    layers_of(merged)[1].recurrent_states[0].add_(1.0)                    # the batch moves on in place ...
    layers_of(merged)[0].keys.add_(1.0)
    for row, alone in zip(rows, row_caches):                                # ... its rows do not
        assert torch.equal(layers_of(row)[1].recurrent_states[0], layers_of(alone)[1].recurrent_states[0])
        assert torch.equal(layers_of(row)[0].keys, layers_of(alone)[0].keys)


@pytest.fixture(scope="module")
def text_model(tiny_minicpmv46_dir):
    return AutoModelForImageTextToText.from_pretrained(tiny_minicpmv46_dir, dtype=torch.float32).eval()


def _snapshot(cache):
    """Every tensor of the cache, copied (what the cache holds now)."""
    attention, linear = layers_of(cache)
    return [attention.keys.clone(), attention.values.clone(), linear.conv_states[0].clone(),
            linear.recurrent_states[0].clone()]


def _extend(model, cache, start: int, length: int = 4) -> torch.Tensor:
    ids = torch.arange(40, 40 + length).unsqueeze(0)
    positions = torch.arange(start, start + length).unsqueeze(0)
    with torch.inference_mode():
        return model(input_ids=ids, cache=cache, use_cache=True, position_ids=positions,
                     attention_mask=torch.ones((1, start + length), dtype=torch.long)).logits


def test_a_fork_extends_like_a_deep_copy_and_leaves_the_kept_prefix_as_it_was(text_model):
    """A kept frame prefix is reused through `fork` (not copy.deepcopy): attention tensors are shared, linear
    states copied. Extending the fork must give a deep copy's logits and leave every tensor of the prefix as it was;
    sharing the linear states as well (the control) would change the prefix, which is why they are copied."""
    import copy

    prefix = DynamicCache(config=text_model.config)
    _extend(text_model, prefix, 0, length=7)
    before = _snapshot(prefix)
    forked = cache_ops.fork(prefix)
    assert layers_of(forked)[0].keys.data_ptr() == layers_of(prefix)[0].keys.data_ptr()       # shared, not copied
    assert layers_of(forked)[1].recurrent_states[0].data_ptr() != layers_of(prefix)[1].recurrent_states[0].data_ptr()
    assert torch.equal(_extend(text_model, forked, 7), _extend(text_model, copy.deepcopy(prefix), 7))
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(prefix), before))
    assert forked.get_seq_length() == 11 and prefix.get_seq_length() == 7

    shared = cache_ops.fork(prefix)                                       # the control: linear states shared too
    layers_of(shared)[1].conv_states[0] = layers_of(prefix)[1].conv_states[0]
    layers_of(shared)[1].recurrent_states[0] = layers_of(prefix)[1].recurrent_states[0]
    _extend(text_model, shared, 7)
    assert not all(torch.equal(a, b) for a, b in zip(_snapshot(prefix), before))
