"""Continuous batched decoding for transformers language models: the model-thread half of batching.

Rows join a running decode and leave it the moment they end. A row's prompt is split after the last image token
into a *prefix* (system prompt, earlier turns, image tokens) and a *suffix* (the rest, up to the generation prompt);
the prefix KV comes from the FrameCache when this frame (exact) or a near-identical one (similar) was prefilled
before (then only the suffix is prefilled), else the prefix is prefilled with the images and kept. Cold rows that
join together are prefilled together, left-padded, where the model allows it (prefill_together.py; images that
stack along the batch, or MiniCPM-V's NaViT-packed ones; plain or hybrid linear/full attention caches), then cut
back into one unpadded cache per row (cache_ops.split_rows); the others are prefilled alone. The new rows' caches
are then merged into the running batch with left padding (cache_ops.py) and all live rows decode together, one
token per row per step, each with its own sampling (greedy, or seeded temperature/top-p/top-k), its own grammar and
its own token limit; positions are kept per row, so padding never shifts them.

Between steps the decoder asks `take_more(num_live)` for rows that arrived meanwhile (the service hands them from
its queue without waiting): a new request waits at most one step, not for the whole batch. A row that ends (EOS,
its token limit, or its `cancelled` event set) is handed back at once through `on_done` and its row is freed.

A row prefilled alone goes through the model in pieces of at most `prefill_chunk_tokens` tokens of text (the
span of image tokens stays in one piece, which carries the image inputs), each on the cache the ones before it
filled; between pieces the row's `cancelled` event is read, so a request whose client went away or timed out frees
the model thread within one piece. Cold rows prefilled together are only those whose prompt is one piece. A row also
stops at the end of the model's context (`max_context_tokens`), as at its token limit.

Rows may carry their prompt as embeddings (`PromptInputs.prefix_embeds`) instead of image tensors: an engine that
builds its own multimodal embeddings (MiniCPM-o) then gives the decoder its inner language model.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from transformers import DynamicCache

from inference_worker.engines.base import RowCancelled
from inference_worker.engines.hf import cache_ops
from inference_worker.engines.hf.packed_images import packs_images
from inference_worker.engines.hf.prefill_together import PrefillTogether
from inference_worker.engines.hf.rows import PromptInputs, Row, RowResult
from inference_worker.engines.hf.sampling import TokenSampler, argmax_lines
from inference_worker.engines.hf.loading import vision_seconds
from inference_worker.engines.hf.text_path import text_path

if TYPE_CHECKING:
    from inference_worker.engines.hf.frame_cache import FrameCache
    from inference_worker.engines.hf.grammar import SchemaGrammars

log = logging.getLogger("deskeye.worker")

#: tokens of text in one prefill forward (a row's images' tokens come on top, in one piece): the most a cancelled
#: row keeps the model thread after its client went away
PREFILL_CHUNK_TOKENS = 512

OnRowDone = Callable[[int, "RowResult | Exception"], None]
#: (rows decoding now) -> new (index, Row) pairs to join the decode; [] when none are waiting
TakeMore = Callable[[int], Sequence[tuple[int, Row]]]


@dataclass
class _Live:
    """A row being decoded."""
    index: int
    row: Row
    sampler: TokenSampler
    cache: DynamicCache | None
    num_prompt_tokens: int
    kv_cache: str
    joined_s: float
    first_token_s: float = 0.0
    slot: int = 0                    # its row in the GrammarBatch
    grammar_s: float = 0.0           # its share of the grammar's time, read when it leaves
    vision_s: float = 0.0            # the model's image encoding in its prefill (a group prefilled together: a share)
    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] | None = None
    max_live: int = 1
    live_sum: int = 0                # sum over its steps of the rows live
    num_steps: int = 0


@dataclass
class _Batch:
    """The running decode: its live rows, merged cache, attention mask and per-row positions."""
    live: list[_Live] = field(default_factory=list)
    cache: DynamicCache | None = None
    mask: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    grammar: Any = None              # GrammarBatch once a constrained row joined
    joining: list[_Live] = field(default_factory=list)   # prefilled, not merged yet
    is_padded: bool = False          # some row is left-padded (set whenever rows join or leave)


class BatchDecoder(PrefillTogether):
    """Runs the continuous decode on one model; called only from the worker's model thread."""

    def __init__(self, model: Any, *, eos_token_ids: Sequence[int], frame_cache: "FrameCache | None" = None,
                 grammars: Callable[[], "SchemaGrammars"] | None = None, can_merge: bool = True,
                 can_prefill_together: bool = False, keep_logits: bool = False,
                 prefill_chunk_tokens: int = PREFILL_CHUNK_TOKENS, max_context_tokens: int | None = None):
        if prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be at least 1; got {prefill_chunk_tokens}.")
        self.model = model
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.frame_cache = frame_cache
        self.grammars = grammars
        self.can_merge = can_merge        # False: a cache that left padding cannot merge; rows decode alone
        #: cold rows that join together are prefilled in one left-padded forward (engine.can_prefill_together);
        #: else each row is prefilled alone
        self.can_prefill_together = can_prefill_together and can_merge
        #: image tensors packed NaViT-style into one row (MiniCPM-V: packed_images.py), not stacked along the batch
        self.packs_images = packs_images(model)
        self.keep_logits = keep_logits
        self.plain_positions = has_plain_positions(model)   # else the model computes positions itself
        #: text tokens per prefill forward; a model that computes positions itself is prefilled in one forward
        self.prefill_chunk_tokens = prefill_chunk_tokens
        #: a row stops once its prompt and answer fill this many positions (None: no such bound)
        self.max_context_tokens = max_context_tokens
        self.image_placeholders = image_placeholder_ids(model.config)
        self.prebuilds_step_mask = can_prebuild_step_mask(model)
        #: decode steps and text-only forwards through the text decoder and lm_head (text_path.py), where they give
        #: the model's logits
        self.text_path = text_path(model, positions_kwarg=self.plain_positions)
        self.live_rows = 0                # rows decoding right now (EngineStats.live_rows)
        self.num_steps = 0                # batched decode steps so far
        self.num_row_steps = 0            # sum over those steps of the rows decoded: / num_steps = mean live rows

    def run(self, rows: Sequence[Row], on_done: OnRowDone) -> None:
        """Generate every row; `on_done(index in rows, result)` is called the moment that row ends."""
        self.run_indexed(list(enumerate(rows)), on_done)

    def run_indexed(self, rows: Sequence[tuple[int, Row]], on_done: OnRowDone, take_more: TakeMore | None = None,
                    ) -> None:
        """Generate every (index, row), and the rows `take_more` hands over while decoding; `on_done(index,
        result)` is called the moment row `index` ends. A row whose prefill fails, or whose `on_done` raises, gets
        its exception there and the others go on; a failing batched step raises (every live row left). Without
        `can_merge` rows decode one after the other and `take_more` is not asked (the next call takes them)."""
        if not self.can_merge:
            for index, row in rows:
                self._decode([(index, row)], on_done, None)
            return
        self._decode(list(rows), on_done, take_more)

    # ------------------------------------------------------------ the loop

    def _decode(self, first: list[tuple[int, Row]], on_done: OnRowDone, take_more: TakeMore | None) -> None:
        batch = _Batch()
        try:
            self._admit(batch, first, on_done)
            while True:
                if take_more is not None:
                    self._admit(batch, take_more(len(batch.live)), on_done)
                if not batch.live:
                    return
                self._step(batch)
                self._retire(batch, on_done)
        finally:
            self.live_rows = 0
            if batch.grammar is not None:
                batch.grammar.close()

    def _admit(self, batch: _Batch, rows: Sequence[tuple[int, Row]], on_done: OnRowDone) -> None:
        """Prefill the new rows (cold ones together where they can be, else each alone), sample their first
        tokens, hand back the ones already finished and merge the others into the running batch."""
        joined = batch.joining
        live_rows = [(index, row) for index, row in rows if not row.cancelled.is_set()]
        for index, row in rows:
            if row.cancelled.is_set():
                _finish(on_done, index, RowCancelled())
        admitted_s = time.perf_counter()               # each row's time to first token counts from here
        vision_before_s = vision_seconds(self.model)
        prefilled = self._prefill_cold_together(live_rows)
        num_together = sum(isinstance(found, tuple) for found in prefilled.values())
        shared_vision_s = (vision_seconds(self.model) - vision_before_s) / max(1, num_together)
        for index, row in live_rows:
            vision_before_s = vision_seconds(self.model)
            try:
                state = self._start_row(batch, index, row, prefilled.get(index), admitted_s)
            except Exception as exc:  # noqa: BLE001 - a request the model cannot prefill fails alone
                _finish(on_done, index, exc)
                continue
            state.vision_s = shared_vision_s if isinstance(prefilled.get(index), tuple) \
                else vision_seconds(self.model) - vision_before_s
            if self._is_finished(state):
                self._release(batch, state)
                _finish(on_done, index, self._result(state, batch))
            else:
                joined.append(state)
        if joined:
            self._merge(batch, joined)
        batch.joining = []

    def _merge(self, batch: _Batch, joined: list[_Live]) -> None:
        caches = [s.cache for s in joined]
        if batch.cache is None:
            batch.cache, batch.mask = cache_ops.merge(caches)
        else:
            batch.cache, batch.mask = cache_ops.append(batch.cache, batch.mask, caches)
        for state in joined:
            state.cache = None                        # the merged cache owns the tensors now
        positions = torch.tensor([[s.num_prompt_tokens + len(s.tokens) - 1] for s in joined], device=batch.mask.device)
        batch.positions = positions if batch.positions is None else torch.cat([batch.positions, positions])
        batch.live.extend(joined)
        batch.is_padded = not bool(batch.mask.all())
        self.live_rows = len(batch.live)

    def _step(self, batch: _Batch) -> None:
        """One token for every live row."""
        live = batch.live
        last = torch.tensor([[s.tokens[-1]] for s in live], device=batch.mask.device)
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones((len(live), 1))], dim=1)
        step = dict(input_ids=last, attention_mask=self._step_mask(batch), cache=batch.cache,
                    **self._positions(batch.positions))
        with torch.inference_mode():
            if self.text_path is not None:
                logits = self.text_path(**step)
            else:
                logits = self.model(**step, use_cache=True, logits_to_keep=1).logits[:, -1, :]
        self._append_tokens(live, logits, batch.grammar)
        batch.positions = batch.positions + 1
        self.num_steps += 1
        self.num_row_steps += len(live)
        for state in live:
            state.max_live = max(state.max_live, len(live))
            state.live_sum += len(live)
            state.num_steps += 1

    def _retire(self, batch: _Batch, on_done: OnRowDone) -> None:
        """Hand back the rows that ended or were cancelled, and drop their rows from the batch."""
        keep = [i for i, s in enumerate(batch.live) if not (self._is_finished(s) or s.row.cancelled.is_set())]
        if len(keep) == len(batch.live):
            return
        kept = set(keep)
        for state in (s for i, s in enumerate(batch.live) if i not in kept):
            self._release(batch, state)
            outcome = RowCancelled() if state.row.cancelled.is_set() and not self._is_finished(state) \
                else self._result(state, batch)
            _finish(on_done, state.index, outcome)
        batch.live = [batch.live[i] for i in keep]
        self.live_rows = len(batch.live)
        if not batch.live:
            batch.cache = batch.mask = batch.positions = None
            return
        indices = torch.tensor(keep, device=batch.mask.device)
        cache_ops.select_rows(batch.cache, indices)
        batch.mask, batch.positions = batch.mask[indices], batch.positions[indices]
        batch.mask = cache_ops.trim_left(batch.cache, batch.mask)
        batch.is_padded = not bool(batch.mask.all())

    def _step_mask(self, batch: _Batch) -> torch.Tensor:
        """The step's attention mask. Where rows are left-padded, a plain-attention model under sdpa gets the 4-D
        boolean mask itself: one query per row that attends to the row's unpadded columns, which is what transformers
        would otherwise rebuild from the 2-D mask at every step (create_causal_mask: ~9% of the model thread at 8
        rows) and now uses as it is. Without padding the 2-D mask lets transformers skip the mask altogether."""
        if batch.is_padded and self.prebuilds_step_mask:
            return batch.mask[:, None, None, :].bool()
        return batch.mask

    # ------------------------------------------------------------ rows

    def _start_row(self, batch: _Batch, index: int, row: Row, prefilled: Any = None,
                   joined_s: float | None = None) -> _Live:
        """Prefill (unless `prefilled` holds the row's (cache, logits, level) already, or its frame Lookup) and
        sample the row's first token."""
        joined_s = time.perf_counter() if joined_s is None else joined_s
        if isinstance(prefilled, tuple):
            cache, logits, kv_cache = prefilled
        else:
            cache, logits, kv_cache = self._prefill(row.inputs, prefilled, row.cancelled)
        state = _Live(index, row, TokenSampler(row.sampling, logits.device), cache, row.inputs.num_tokens, kv_cache,
                      joined_s=joined_s, logits=[] if self.keep_logits else None)
        state.slot = self._grammar_slot(batch, row)
        try:
            self._append_tokens([state], logits.unsqueeze(0), batch.grammar)
        except Exception:
            self._release(batch, state)              # its grammar row, which no one else would free
            raise
        state.first_token_s = time.perf_counter()
        return state

    def _grammar_slot(self, batch: _Batch, row: Row) -> int:
        """The row's line in the batch's GrammarBatch (made when the first constrained row arrives)."""
        if batch.grammar is None:
            if row.grammar is None or self.grammars is None:
                return 0
            from inference_worker.engines.hf.grammar import GrammarBatch
            batch.grammar = GrammarBatch(self.grammars(), [])
            for state in (*batch.live, *batch.joining):
                state.slot = batch.grammar.add(None)
        return batch.grammar.add(row.grammar if self.grammars is not None else None)

    def _release(self, batch: _Batch, state: _Live) -> None:
        """Free the row's grammar line (after its result has read the grammar's time)."""
        state.grammar_s = batch.grammar.elapsed_s_for(state.slot) if batch.grammar is not None else 0.0
        if batch.grammar is not None:
            batch.grammar.release(state.slot)

    def _append_tokens(self, live: list[_Live], logits: torch.Tensor, grammar) -> None:
        """Mask and sample one token for each live row from its logits (len(live), vocab)."""
        logits = logits.float()
        is_greedy = [s.sampler.is_greedy for s in live]
        if grammar is not None:
            slots = [s.slot for s in live]
            with torch.inference_mode():       # the grammar masks the forward's (inference) tensor in place
                picked = grammar.apply(logits, slots, greedy=is_greedy)
        else:
            picked = argmax_lines(logits)
        tokens = [picked[i] if is_greedy[i] else s.sampler.sample(logits[i]) for i, s in enumerate(live)]
        if grammar is not None:
            grammar.advance(slots, tokens)
        for i, (state, token) in enumerate(zip(live, tokens)):
            self._append(state, token, logits[i])

    def _append(self, state: _Live, token: int, logits: torch.Tensor) -> None:
        """The one place a row's new token is recorded (a streaming callback belongs here)."""
        state.tokens.append(token)
        if state.row.on_token is not None:
            state.row.on_token(token)
        if state.logits is not None:
            state.logits.append(logits.clone())

    def _is_finished(self, state: _Live) -> bool:
        """EOS, the row's token limit, or the end of the model's context."""
        num_tokens = len(state.tokens)
        return (state.tokens[-1] in self.eos_token_ids or num_tokens >= state.row.sampling.max_tokens
                or (self.max_context_tokens is not None
                    and state.num_prompt_tokens + num_tokens >= self.max_context_tokens))

    def _result(self, state: _Live, batch: _Batch) -> RowResult:
        is_eos = state.tokens[-1] in self.eos_token_ids
        return RowResult(state.tokens, is_eos, state.num_prompt_tokens, state.kv_cache, state.max_live,
                         ttft_s=state.first_token_s - state.joined_s,
                         decode_s=time.perf_counter() - state.first_token_s,
                         grammar_s=state.grammar_s, vision_s=state.vision_s,
                         is_constrained=state.row.grammar is not None and batch.grammar is not None,
                         mean_live_rows=state.live_sum / state.num_steps if state.num_steps else 1.0,
                         logits=state.logits)

    # ------------------------------------------------------------ prefill with frame reuse

    def _prefill(self, inputs: PromptInputs, found: Any = None, cancelled: threading.Event | None = None,
                 ) -> tuple[DynamicCache, torch.Tensor, str]:
        """This row's cache after its whole prompt, the logits for its first token, and what reuse happened.
        `found`: the row's FrameCache Lookup when it was made already (None: look it up here). RowCancelled once
        `cancelled` is set between two pieces of the prefill."""
        found = found if found is not None else self._lookup(inputs)
        if found is None:
            cache, logits = self._cold(inputs, cancelled)
            return cache, logits, "off" if inputs.num_images else "none"
        if found.value is None:
            cache, logits, prefix_cache = self._prefill_and_keep_prefix(inputs, cancelled)
            self._keep_prefix(inputs, prefix_cache)
            return cache, logits, found.level
        cache, logits = self._forward(cache_ops.fork(found.value), ids=inputs.suffix_ids,
                                      num_past=int(inputs.prefix_ids.shape[1]), cancelled=cancelled)
        return cache, logits, found.level

    def _lookup(self, inputs: PromptInputs):
        """The row's frame in the FrameCache (a Lookup), or None when reuse is off for it."""
        frame_cache, frame = self.frame_cache, inputs.frame
        if frame is None or frame_cache is None or frame_cache.max_bytes == 0:
            return None
        return frame_cache.lookup(frame.exact_key, frame.group_key, frame.signature, frame.nearest)

    def _keep_prefix(self, inputs: PromptInputs, prefix_cache: DynamicCache) -> None:
        from inference_worker.engines.hf.frame_cache import tensor_nbytes
        frame = inputs.frame
        self.frame_cache.put(frame.exact_key, frame.group_key, frame.signature, prefix_cache,
                             tensor_nbytes(prefix_cache))

    def _cold(self, inputs: PromptInputs, cancelled: threading.Event | None = None,
              ) -> tuple[DynamicCache, torch.Tensor]:
        if inputs.prefix_embeds is None:
            return self._forward(self._new_cache(), ids=inputs.all_ids(), vision=inputs.vision, num_past=0,
                                 cancelled=cancelled)
        cache, _ = self._forward(self._new_cache(), embeds=inputs.prefix_embeds, num_past=0, cancelled=cancelled)
        return self._forward(cache, ids=inputs.suffix_ids, num_past=int(inputs.prefix_ids.shape[1]),
                             cancelled=cancelled)

    def _prefill_and_keep_prefix(self, inputs: PromptInputs, cancelled: threading.Event | None = None,
                                 ) -> tuple[DynamicCache, torch.Tensor, DynamicCache]:
        """A cold prefill that also yields the frame prefix's cache to keep. Plain attention caches are prefilled
        whole and the prefix copied out (one forward: the cold path itself); other caches (recurrent state
        cannot be cut) prefill the prefix, keep it, then the suffix on a fork of it."""
        num_prefix = int(inputs.prefix_ids.shape[1])
        if cache_ops.is_plain_attention(self._new_cache()) and inputs.prefix_embeds is None:
            cache, logits = self._cold(inputs, cancelled)
            return cache, logits, cache_ops.prefix_of(cache, num_prefix)
        if inputs.prefix_embeds is not None:
            prefix_cache, _ = self._forward(self._new_cache(), embeds=inputs.prefix_embeds, num_past=0,
                                            cancelled=cancelled)
        else:
            prefix_cache, _ = self._forward(self._new_cache(), ids=inputs.prefix_ids, vision=inputs.vision, num_past=0,
                                            cancelled=cancelled)
        cache, logits = self._forward(cache_ops.fork(prefix_cache), ids=inputs.suffix_ids, num_past=num_prefix,
                                      cancelled=cancelled)
        return cache, logits, prefix_cache

    def _new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    def _forward(self, cache: DynamicCache, *, num_past: int, ids: torch.Tensor | None = None,
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
            cache, logits = self._forward_once(cache, num_past=num_past + start,
                                               ids=None if ids is None else ids[:, piece],
                                               embeds=None if embeds is None else embeds[:, piece],
                                               vision=vision if holds_images else None)
        return cache, logits

    def prefill_pieces(self, tokens: torch.Tensor, vision: dict[str, torch.Tensor] | None = None,
                       ) -> list[tuple[int, int]]:
        """[start, end) of each forward a row's `tokens` (ids or embeddings, (1, n, ...)) are prefilled in."""
        return self._pieces(int(tokens.shape[1]), vision, self._image_span(tokens) if vision else None)

    def num_prefill_pieces(self, inputs: PromptInputs) -> int:
        """How many forwards the row's cold prefill takes alone (1: it may be prefilled with other rows)."""
        if inputs.prefix_embeds is not None:
            return len(self.prefill_pieces(inputs.prefix_embeds)) + len(self.prefill_pieces(inputs.suffix_ids))
        return len(self.prefill_pieces(inputs.all_ids(), inputs.vision))

    def _pieces(self, length: int, vision: dict | None, span: tuple[int, int] | None) -> list[tuple[int, int]]:
        """One piece for a model that computes positions itself, or whose image inputs come without placeholder
        tokens to keep together; else `prefill_pieces`."""
        if not self.plain_positions or (vision and span is None):
            return [(0, length)]
        return prefill_pieces(length, self.prefill_chunk_tokens, span)

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

    def _forward_once(self, cache: DynamicCache, *, num_past: int, ids: torch.Tensor | None = None,
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


def _finish(on_done: OnRowDone, index: int, outcome: "RowResult | Exception") -> None:
    """Hand a row's outcome over; a callback that raises makes that exception the row's outcome, once."""
    try:
        on_done(index, outcome)
    except Exception as exc:  # noqa: BLE001 - a failing callback fails its own row only
        log.warning("the completion callback of row %d failed: %s", index, exc)
        if isinstance(outcome, Exception):
            return
        try:
            on_done(index, exc)
        except Exception:  # noqa: BLE001
            log.warning("the completion callback of row %d failed again", index, exc_info=True)


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


def can_merge_caches(model: Any) -> bool:
    """Whether rows of this model can be decoded together: its cache layers are ones cache_ops merges (plain or
    linear attention: no sliding window) and its positions are plain 1-D ones."""
    return has_plain_positions(model) and cache_ops.can_merge_layers(DynamicCache(config=model.config))


def can_prebuild_step_mask(model: Any) -> bool:
    """Whether a decode step may hand the model its 4-D boolean mask (BatchDecoder._step_mask): plain attention
    layers only (a linear-attention layer reads the 2-D mask) under sdpa, which takes a boolean mask as it is."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    implementation = getattr(decoder.config, "_attn_implementation", None)
    return implementation == "sdpa" and cache_ops.is_plain_attention(DynamicCache(config=model.config))


def has_plain_positions(model: Any) -> bool:
    """False for M-RoPE models that compute positions from the image grid (Qwen2-VL style: `get_rope_index`) and
    keep position state between calls (`rope_deltas`): neither a reused prefix nor explicit position ids are safe
    for them. A text model with M-RoPE sections whose model passes plain positions (MiniCPM-V 4.6) is plain."""
    inner = getattr(model, "model", model)
    return not any(hasattr(obj, name) for obj in (model, inner) for name in ("get_rope_index", "rope_deltas"))
