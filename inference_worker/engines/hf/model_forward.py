"""Every forward the batch decoder runs through the model, in one place: a row's prefill in pieces, a batched decode
step, and one left-padded forward over several rows' prompts.

A row prefilled alone goes through the model in pieces of at most `chunk_tokens` tokens of text (the span of image
tokens stays in one piece, which carries the image inputs), each on the cache the ones before it filled; between
pieces the row's `cancelled` event is read, so a request whose client went away or timed out frees the model thread
within one piece. Decode steps and text-only forwards go through the text decoder and lm_head (text_path.py) where
that pair gives the model's logits. Positions are explicit per row where the model's are plain (1-D), so left padding
never shifts them; a model that computes positions itself (M-RoPE from the image grid) gets none and one piece. Every
forward here reads the last position's logits only: a model whose forward cannot be told so (no `logits_to_keep`)
has its head given that position alone (`head_on_last_position`).
"""

from __future__ import annotations

import inspect
import threading
from typing import Any

import torch
from transformers import DynamicCache

from inference_worker.engines.base import RowCancelled
from inference_worker.engines.hf import cache_ops
from inference_worker.engines.hf.int8_decode import decode_steps
from inference_worker.engines.hf.text_path import text_path

#: tokens of text in one prefill forward (a row's images' tokens come on top, in one piece): the most a cancelled
#: row keeps the model thread after its client went away
PREFILL_CHUNK_TOKENS = 512


class ModelForward:
    """The model's forwards for the batch decoder (model thread only). `text_path` (None: the model's own forward)
    and `chunk_tokens` may be swapped by tests and benchmarks."""

    def __init__(self, model: Any, *, chunk_tokens: int = PREFILL_CHUNK_TOKENS):
        if chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be at least 1; got {chunk_tokens}.")
        self.model = model
        head_on_last_position(model)
        self.plain_positions = has_plain_positions(model)   # else the model computes positions itself
        #: text tokens per prefill forward; a model that computes positions itself is prefilled in one forward
        self.chunk_tokens = chunk_tokens
        self.image_placeholders = image_placeholder_ids(model.config)
        #: decode steps and text-only forwards through the text decoder and lm_head, where they give its logits
        self.text_path = text_path(model, positions_kwarg=self.plain_positions)

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    def prefill(self, cache: DynamicCache, *, num_past: int, ids: torch.Tensor | None = None,
                embeds: torch.Tensor | None = None, vision: dict[str, torch.Tensor] | None = None,
                cancelled: threading.Event | None = None) -> tuple[DynamicCache, torch.Tensor]:
        """One row's prefill over `ids` (or `embeds`) after `num_past` cached tokens, in the pieces `prefill_pieces`
        plans (the image inputs go with the piece that holds the image tokens); RowCancelled when `cancelled` is set
        before a piece. Returns the cache and the last position's logits."""
        tokens = ids if ids is not None else embeds
        length = int(tokens.shape[1])
        span = self._image_span(tokens) if vision else None
        logits = None
        for start, end in self._pieces(length, vision, span):
            if cancelled is not None and cancelled.is_set():
                raise RowCancelled()
            piece = slice(start, end) if (start, end) != (0, length) else slice(None)   # whole: the tensors as given
            holds_images = bool(vision) and (span is None or start <= span[0] < end)
            cache, logits = self._once(cache, num_past=num_past + start, ids=None if ids is None else ids[:, piece],
                                       embeds=None if embeds is None else embeds[:, piece],
                                       vision=vision if holds_images else None)
        return cache, logits

    def prefill_pieces(self, tokens: torch.Tensor, vision: dict[str, torch.Tensor] | None = None,
                       ) -> list[tuple[int, int]]:
        """[start, end) of each forward a row's `tokens` (ids or embeddings, (1, n, ...)) are prefilled in."""
        return self._pieces(int(tokens.shape[1]), vision, self._image_span(tokens) if vision else None)

    def step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: DynamicCache,
             positions: torch.Tensor) -> torch.Tensor:
        """One decode step: a token per row (`input_ids` (rows, 1)) on the merged cache; the logits (rows, vocab)."""
        step = dict(input_ids=input_ids, attention_mask=attention_mask, cache=cache, **self._positions(positions))
        with torch.inference_mode(), decode_steps():       # int8 copies where the model has them (int8_decode.py)
            if self.text_path is not None:
                return self.text_path(**step)
            return self.model(**step, use_cache=True, logits_to_keep=1).logits[:, -1, :]

    def prefill_rows(self, ids: list[torch.Tensor], vision: dict[str, torch.Tensor], *,
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
            cache, mask = self.new_cache(), new_mask
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

    # ------------------------------------------------------------ helpers

    def _pieces(self, length: int, vision: dict | None, span: tuple[int, int] | None) -> list[tuple[int, int]]:
        """One piece for a model that computes positions itself, or whose image inputs come without placeholder
        tokens to keep together; else `prefill_pieces`."""
        if not self.plain_positions or (vision and span is None):
            return [(0, length)]
        return prefill_pieces(length, self.chunk_tokens, span)

    def _image_span(self, ids: torch.Tensor) -> tuple[int, int] | None:
        """[first, last + 1) of the image placeholder tokens in `ids` (1, n); None when there are none (or `ids`
        are embeddings)."""
        if ids.dtype.is_floating_point or not self.image_placeholders:
            return None
        is_image = torch.isin(ids[0], torch.tensor(sorted(self.image_placeholders), device=ids.device))
        where = is_image.nonzero()
        if not len(where):
            return None
        return int(where[0]), int(where[-1]) + 1

    def _once(self, cache: DynamicCache, *, num_past: int, ids: torch.Tensor | None = None,
              embeds: torch.Tensor | None = None, vision: dict[str, torch.Tensor] | None = None,
              ) -> tuple[DynamicCache, torch.Tensor]:
        """One row's forward over `ids` (or `embeds`) after `num_past` cached tokens."""
        length = ids.shape[1] if ids is not None else embeds.shape[1]
        device = ids.device if ids is not None else embeds.device
        mask = torch.ones((1, num_past + length), dtype=torch.long, device=device)
        positions = torch.arange(num_past, num_past + length, device=device).unsqueeze(0)
        if ids is not None and not vision and self.text_path is not None:     # text only: an exact hit's suffix
            with torch.inference_mode():
                logits = self.text_path(input_ids=ids, attention_mask=mask, cache=cache, **self._positions(positions))
            return cache, logits[0]
        tokens = {"input_ids": ids} if ids is not None else {"inputs_embeds": embeds}
        with torch.inference_mode():
            out = self.model(**tokens, attention_mask=mask, cache=cache, use_cache=True, logits_to_keep=1,
                             **self._positions(positions), **(vision or {}))
        return cache, out.logits[0, -1, :]

    def _positions(self, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        """position_ids for the forward: explicit per row where positions are plain, else the model's own."""
        return {"position_ids": positions} if self.plain_positions else {}

    def _filler_token(self, ids: torch.Tensor) -> int:
        """A token for the padding (masked out, so any real one), but never an image or video placeholder: the model
        counts those to place the image features (a prefix ends on one)."""
        return next((token for token in ids[0].tolist() if token not in self.image_placeholders), int(ids[0, 0]))


def head_on_last_position(model: Any) -> bool:
    """Make the model's lm_head read only the last position of a forward over several, for a model whose forward
    has no `logits_to_keep` (transformers' MiniCPM-V 4.6 applies its 248k-row head to every prompt position: 181 ms
    and 157 MB of logits for an 800x600 prompt of 317 tokens at real size, 374 ms and 350 MB at 1920x1080, of which
    every caller here reads the last position only). A forward pre-hook on the head, installed once; True where it
    is (or was already) installed."""
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        return False
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Module):
        return False
    if not getattr(head, "reads_last_position", False):
        head.register_forward_pre_hook(_last_position)
        head.reads_last_position = True
    return True


def _last_position(module: Any, args: tuple) -> tuple | None:
    hidden = args[0] if args else None
    if isinstance(hidden, torch.Tensor) and hidden.dim() == 3 and hidden.shape[1] > 1:
        return (hidden[:, -1:, :], *args[1:])
    return None


def prefill_pieces(length: int, chunk_tokens: int, image_span: tuple[int, int] | None = None,
                   ) -> list[tuple[int, int]]:
    """[start, end) of the forwards that prefill `length` tokens: each takes at most `chunk_tokens` tokens of text,
    and the `image_span` [first, last + 1) of image tokens is never cut (its tokens come on top of the piece it falls
    in: the image inputs belong to one forward)."""
    first, last = image_span if image_span is not None else (length, length)
    pieces, start = [], 0
    while start < length:
        end = start + chunk_tokens
        if start <= first < end:                   # the images' tokens ride along, whole
            end = last + (end - first)
        end = min(end, length)
        pieces.append((start, end))
        start = end
    return pieces


def image_placeholder_ids(config: Any) -> frozenset[int]:
    """The token ids a model replaces with image (or video) features."""
    ids = (getattr(config, name, None) for name in ("image_token_id", "image_token_index", "video_token_id"))
    return frozenset(int(i) for i in ids if isinstance(i, int) and not isinstance(i, bool))


def has_plain_positions(model: Any) -> bool:
    """False for M-RoPE models that compute positions from the image grid (Qwen2-VL style: `get_rope_index`) and
    keep position state between calls (`rope_deltas`): neither a reused prefix nor explicit position ids are safe
    for them. A text model with M-RoPE sections whose model passes plain positions (MiniCPM-V 4.6) is plain."""
    inner = getattr(model, "model", model)
    return not any(hasattr(obj, name) for obj in (model, inner) for name in ("get_rope_index", "rope_deltas"))
