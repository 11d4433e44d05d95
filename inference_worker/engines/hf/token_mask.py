"""Packed token masks: one bit per vocabulary token in int32 words (bit i of word w = token 32*w+i), the
layout llguidance fills. Packing, unpacking, and writing -inf into logits where a bit says a token is banned.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

BITS_PER_WORD = 32


def pack_token_ids(vocab_size: int, token_ids: Sequence[int], *, allowed: bool) -> np.ndarray:
    """A packed int32 mask of `vocab_size` tokens (bit i of word w = token 32*w+i): `token_ids` set to
    `allowed`, every other token to the opposite; padding bits past vocab_size are 0."""
    bits = np.full(vocab_size, not allowed, dtype=bool)
    bits[[t for t in token_ids if t < vocab_size]] = allowed
    packed = np.packbits(bits, bitorder="little")
    padded = np.zeros(-(-vocab_size // BITS_PER_WORD) * 4, dtype=np.uint8)
    padded[: packed.size] = packed
    return padded.view(np.int32)


def fill_banned_words(logits: torch.Tensor, banned_words: np.ndarray) -> None:
    """-inf into contiguous CPU `logits` (rows, 32 * num_words) wherever `banned_words` (rows, num_words)
    has a bit set: a whole word's 32 tokens at once where all are banned, bit by bit only in the few mixed
    words. About 2x faster than a bool masked_fill_ at 150k tokens, which does not vectorise on the CPU."""
    blocks = logits.view(-1, BITS_PER_WORD)
    flat = banned_words.reshape(-1)
    whole = np.flatnonzero(flat == -1)
    if whole.size:
        blocks.index_fill_(0, torch.from_numpy(whole), float("-inf"))
    mixed = np.flatnonzero((flat != 0) & (flat != -1))
    if mixed.size:
        index = torch.from_numpy(mixed)
        bits = torch.from_numpy(unpack_words(flat[mixed, None], BITS_PER_WORD))
        blocks.index_copy_(0, index, blocks.index_select(0, index).masked_fill_(bits, float("-inf")))


def unpack_words(words: np.ndarray, width: int) -> np.ndarray:
    """(rows, num_words) int32 -> (rows, width) bool, bit i of word w = column 32*w+i; columns past the
    words' bits come out False. One numpy call (the bytes of an int32 are little-endian on every host
    DeskEye runs on: x86-64, arm64)."""
    if not words.flags.c_contiguous:
        words = np.ascontiguousarray(words)
    return np.unpackbits(words.view(np.uint8), axis=1, count=width, bitorder="little").view(bool)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(rows, words) int32 bitmask, bit i of word w = token 32*w+i -> (rows, vocab_size) bool.

    Tokens past the mask's width (an lm_head wider than the tokenizer) come out disallowed.
    """
    return torch.from_numpy(unpack_words(bitmask.cpu().numpy(), vocab_size))
