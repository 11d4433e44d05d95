"""Continuous batched decoding for transformers language models: the model-thread half of batching.

Rows join a running decode and leave it the moment they end. Each new row is prefilled into a cache of its own
(row_prefill.py: the frame's prefix KV reused where the FrameCache holds it, the prompt in pieces between which a
cancelled row stops: model_forward.py); cold rows that join together are prefilled together, left-padded, where the
model allows it (prefill_together.py), then cut back into one unpadded cache per row. The new rows' caches are
merged into the running batch with left padding (cache_ops.py) and all live rows decode together, one token per row
per step, each with its own sampling (greedy, or seeded temperature/top-p/top-k), its own grammar and its own token
limit; positions are kept per row, so padding never shifts them.

Between steps the decoder asks `take_more(num_live)` for rows that arrived meanwhile (the service hands them from
its queue without waiting): a new request waits at most one step, not for the whole batch. A row that ends (EOS,
its token limit, the end of the model's context `max_context_tokens`, or its `cancelled` event set) is handed back
at once through `on_done` and its row is freed.

Rows may carry their prompt as embeddings (`PromptInputs.prefix_embeds`) instead of image tensors: an engine that
builds its own multimodal embeddings (MiniCPM-o) then gives the decoder its inner language model.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from transformers import DynamicCache

from inference_worker.engines.base import RowCancelled
from inference_worker.engines.hf import cache_ops
from inference_worker.engines.hf.loading import vision_seconds
from inference_worker.engines.hf.model_forward import PREFILL_CHUNK_TOKENS, ModelForward, has_plain_positions
from inference_worker.engines.hf.packed_images import packs_images
from inference_worker.engines.hf.prefill_together import PrefillTogether
from inference_worker.engines.hf.row_prefill import RowPrefill
from inference_worker.engines.hf.rows import Row, RowResult
from inference_worker.engines.hf.sampling import TokenSampler, argmax_lines
from inference_worker.protocol import CacheLevel

if TYPE_CHECKING:
    from inference_worker.engines.hf.frame_cache import FrameCache
    from inference_worker.engines.hf.grammar import SchemaGrammars

log = logging.getLogger("inference_worker")

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
    kv_cache: CacheLevel
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


class BatchDecoder:
    """Runs the continuous decode on one model; called only from the worker's model thread. Its collaborators:
    `forward` (every forward through the model), `row_prefill` (one row's prefill with frame reuse) and `together`
    (cold rows prefilled in one forward; None where the model cannot)."""

    def __init__(self, model: Any, *, eos_token_ids: Sequence[int], frame_cache: "FrameCache | None" = None,
                 grammars: Callable[[], "SchemaGrammars"] | None = None, can_merge: bool = True,
                 can_prefill_together: bool = False, keep_logits: bool = False,
                 prefill_chunk_tokens: int = PREFILL_CHUNK_TOKENS, max_context_tokens: int | None = None):
        self.model = model
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.grammars = grammars
        self.can_merge = can_merge        # False: a cache that left padding cannot merge; rows decode alone
        self.forward = ModelForward(model, chunk_tokens=prefill_chunk_tokens)
        self.row_prefill = RowPrefill(self.forward, frame_cache)
        #: cold rows that join together are prefilled in one left-padded forward (engine.can_prefill_together);
        #: else each row is prefilled alone
        self.together = PrefillTogether(self.row_prefill, packs_images=packs_images(model)) \
            if can_prefill_together and can_merge else None
        self.keep_logits = keep_logits
        #: a row stops once its prompt and answer fill this many positions (None: no such bound)
        self.max_context_tokens = max_context_tokens
        self.prebuilds_step_mask = can_prebuild_step_mask(model)
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
        prefilled = self.together.prefill(live_rows) if self.together is not None else {}
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
        logits = self.forward.step(last, self._step_mask(batch), batch.cache, batch.positions)
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
            cache, logits, kv_cache = self.row_prefill.prefill(row.inputs, prefilled, row.cancelled)
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
            from inference_worker.engines.hf.grammar_batch import GrammarBatch
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
