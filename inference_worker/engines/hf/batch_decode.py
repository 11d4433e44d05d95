"""One batched generation for transformers vision-language models: the model-thread half of dynamic batching.

Each request is prefilled on its own: its prompt is split after the last image token into a *prefix*
(system prompt, earlier turns, image tokens) and a *suffix* (the rest, up to the generation prompt). The
prefix KV comes from the FrameCache when this frame (exact) or a near-identical one (similar) was prefilled
before; otherwise the prefix is prefilled with the images and kept. Then the rows' caches are merged with left
padding and decoded together, one token per row per step: each row has its own sampling (greedy, or seeded
temperature/top-p/top-k), its own grammar state and its own token limit. A row that ends is handed back at
once through `on_done` and leaves the batch, so a short answer never waits for a long one.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from inference_worker.engines.hf.sampling import TokenSampler, argmax_lines
from inference_worker.protocol import SamplingParams

if TYPE_CHECKING:
    from inference_worker.engines.hf.grammar import SchemaGrammars
    from inference_worker.engines.hf.frame_cache import FrameCache, FrameSignature


@dataclass
class FrameKey:
    """How a prompt's prefix is found in the FrameCache (see frame_cache.py)."""
    exact_key: bytes                 # preprocessed pixels + prefix token ids + model
    group_key: bytes                 # prefix token ids + image layout + model: who may stand in for whom
    signature: "FrameSignature"      # small thumbnails for the similar level
    nearest: tuple[bytes, float] | None = None   # FrameCache.nearest, found while preparing


@dataclass
class PromptInputs:
    """A request's model inputs, made off the model thread by the engine's `prepare`."""
    prefix_ids: torch.Tensor         # (1, p): up to and including the last image token; p = 0 without images
    suffix_ids: torch.Tensor         # (1, s), s >= 1
    vision: dict[str, torch.Tensor]  # the processor's image tensors (pixel_values, ...), for the prefix
    num_images: int = 0
    frame: FrameKey | None = None    # None: no image, or reuse is off
    #: (1, num_tokens, hidden): the whole prompt already embedded by the engine (MiniCPM-o builds its own
    #: inputs_embeds); then prefilled from these instead of the ids and `vision`, and never split for reuse
    inputs_embeds: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.prefix_ids.shape[1] + self.suffix_ids.shape[1])

    def all_ids(self) -> torch.Tensor:
        return torch.cat([self.prefix_ids, self.suffix_ids], dim=1)


@dataclass
class Row:
    """One request in a batch: its inputs, sampling and schema (None = free text)."""
    inputs: PromptInputs
    sampling: SamplingParams
    schema: dict[str, Any] | None = None
    on_token: Callable[[int], None] | None = None   # a streamed row: called with each token as it is chosen


@dataclass
class RowResult:
    token_ids: list[int]
    is_eos: bool
    prompt_tokens: int
    kv_cache: str                    # "exact" | "similar" | "miss" | "off" | "none"
    batch_size: int                  # rows decoded together
    ttft_s: float                    # batch start to this row's first token
    decode_s: float                  # first token to last
    grammar_s: float = 0.0           # this row's share of the grammar's time
    is_constrained: bool = False
    logits: list[torch.Tensor] | None = None   # per step, kept only with `keep_logits` (tests)


@dataclass
class _Live:
    """A row being decoded."""
    index: int
    row: Row
    sampler: TokenSampler
    cache: DynamicCache
    num_prompt_tokens: int
    kv_cache: str
    first_token_s: float
    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] | None = None


class BatchDecoder:
    """Runs batches on one model; called only from the worker's model thread."""

    def __init__(self, model: Any, *, eos_token_ids: Sequence[int], frame_cache: "FrameCache | None" = None,
                 grammars: Callable[[], "SchemaGrammars"] | None = None, can_merge: bool = True,
                 keep_logits: bool = False):
        self.model = model
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.frame_cache = frame_cache
        self.grammars = grammars
        self.can_merge = can_merge        # False: a cache that left padding cannot merge; rows decode alone
        self.keep_logits = keep_logits

    def run(self, rows: Sequence[Row], on_done: Callable[[int, "RowResult | Exception"], None]) -> None:
        """Generate every row; `on_done(index, result)` is called the moment row `index` ends. A row whose prefill
        fails gets its exception there and the others go on; a failing batched step raises (every row left)."""
        if self.can_merge:
            self._run_together(list(enumerate(rows)), on_done, batch_size=len(rows))
        else:
            for index, row in enumerate(rows):
                self._run_together([(index, row)], on_done, batch_size=1)

    # ------------------------------------------------------------ one batch

    def _run_together(self, rows: list[tuple[int, Row]], on_done, *, batch_size: int) -> None:
        started_s = time.perf_counter()
        grammar = self._grammar_batch(rows)
        live: list[_Live] = []
        for index, row in rows:
            try:
                state = self._start_row(index, row, grammar)
            except Exception as exc:  # noqa: BLE001 - a request the model cannot prefill fails alone
                on_done(index, exc)
                continue
            if self._is_finished(state):
                on_done(index, self._result(state, grammar, batch_size, started_s))
            else:
                live.append(state)
        if live:
            self._decode(live, grammar, on_done, batch_size, started_s)

    def _start_row(self, index: int, row: Row, grammar) -> _Live:
        cache, logits, kv_cache = self._prefill(row.inputs)
        state = _Live(index, row, TokenSampler(row.sampling, logits.device), cache, row.inputs.num_tokens, kv_cache,
                      first_token_s=0.0, logits=[] if self.keep_logits else None)
        self._append_tokens([state], logits.unsqueeze(0), grammar)
        state.first_token_s = time.perf_counter()
        return state

    def _decode(self, live: list[_Live], grammar, on_done, batch_size: int, started_s: float) -> None:
        cache, mask = merge_caches([s.cache for s in live])
        for state in live:
            state.cache = None                        # the merged cache owns the tensors now
        positions = torch.tensor([[s.num_prompt_tokens + len(s.tokens) - 1] for s in live], device=mask.device)
        while live:
            last = torch.tensor([[s.tokens[-1]] for s in live], device=mask.device)
            mask = torch.cat([mask, mask.new_ones((len(live), 1))], dim=1)
            with torch.inference_mode():
                out = self.model(input_ids=last, attention_mask=mask, position_ids=positions, cache=cache,
                                 use_cache=True, logits_to_keep=1)
            self._append_tokens(live, out.logits[:, -1, :], grammar)
            positions = positions + 1
            keep = [i for i, s in enumerate(live) if not self._is_finished(s)]
            for state in (s for i, s in enumerate(live) if i not in keep):
                on_done(state.index, self._result(state, grammar, batch_size, started_s))
            if len(keep) < len(live):
                live, mask, positions = [live[i] for i in keep], mask[keep], positions[keep]
                if live:
                    cache.batch_select_indices(torch.tensor(keep, device=mask.device))

    def _append_tokens(self, live: list[_Live], logits: torch.Tensor, grammar) -> None:
        """Mask, sample and record one token for each live row from its logits (len(live), vocab)."""
        logits = logits.float()
        rows = [s.index for s in live]
        is_greedy = [s.sampler.is_greedy for s in live]
        with torch.inference_mode():           # the grammar masks the forward's (inference) tensor in place
            picked = grammar.apply(logits, rows, greedy=is_greedy) if grammar is not None else argmax_lines(logits)
        tokens = [picked[i] if is_greedy[i] else s.sampler.sample(logits[i]) for i, s in enumerate(live)]
        if grammar is not None:
            grammar.advance(rows, tokens)
        for i, (state, token) in enumerate(zip(live, tokens)):
            state.tokens.append(token)
            if state.row.on_token is not None:
                state.row.on_token(token)
            if state.logits is not None:
                state.logits.append(logits[i].clone())

    def _is_finished(self, state: _Live) -> bool:
        return state.tokens[-1] in self.eos_token_ids or len(state.tokens) >= state.row.sampling.max_tokens

    def _result(self, state: _Live, grammar, batch_size: int, started_s: float) -> RowResult:
        is_eos = state.tokens[-1] in self.eos_token_ids
        return RowResult(state.tokens, is_eos, state.num_prompt_tokens, state.kv_cache, batch_size,
                         ttft_s=state.first_token_s - started_s,
                         decode_s=time.perf_counter() - state.first_token_s,
                         grammar_s=grammar.elapsed_s_for(state.index) if grammar is not None else 0.0,
                         is_constrained=state.row.schema is not None and grammar is not None,
                         logits=state.logits)

    def _grammar_batch(self, rows: list[tuple[int, Row]]):
        schemas = [row.schema for _, row in rows]
        if self.grammars is None or all(s is None for s in schemas):
            return None
        from inference_worker.engines.hf.grammar import GrammarBatch
        by_index = {index: row.schema for index, row in rows}
        return GrammarBatch(self.grammars(), [by_index.get(i) for i in range(max(by_index) + 1)])

    # ------------------------------------------------------------ prefill with frame reuse

    def _prefill(self, inputs: PromptInputs) -> tuple[DynamicCache, torch.Tensor, str]:
        """This row's cache after its whole prompt, the logits for its first token, and what reuse happened."""
        frame_cache = self.frame_cache
        if inputs.frame is None or frame_cache is None or frame_cache.max_bytes == 0:
            cache, logits = self._forward(inputs.all_ids(), self._new_cache(), inputs.vision, num_past=0,
                                          inputs_embeds=inputs.inputs_embeds)
            return cache, logits, "off" if inputs.num_images else "none"
        frame = inputs.frame
        found = frame_cache.lookup(frame.exact_key, frame.group_key, frame.signature, frame.nearest)
        if found.value is None:
            cache, logits, prefix_cache = self._prefill_and_keep_prefix(inputs)
            from inference_worker.engines.hf.frame_cache import tensor_nbytes
            frame_cache.put(frame.exact_key, frame.group_key, frame.signature, prefix_cache,
                            tensor_nbytes(prefix_cache))
            return cache, logits, found.level
        cache, logits = self._forward(inputs.suffix_ids, copy.deepcopy(found.value), {},
                                      num_past=int(inputs.prefix_ids.shape[1]))
        return cache, logits, found.level

    def _prefill_and_keep_prefix(self, inputs: PromptInputs) -> tuple[DynamicCache, torch.Tensor, DynamicCache]:
        """A cold prefill that also yields the frame prefix's cache to keep. Plain attention caches are prefilled
        whole and the prefix copied out (one forward: the cold path itself); other caches (recurrent state
        cannot be cut) prefill the prefix, keep a copy, then the suffix."""
        num_prefix = int(inputs.prefix_ids.shape[1])
        if self.can_merge:
            cache, logits = self._forward(inputs.all_ids(), self._new_cache(), inputs.vision, num_past=0)
            prefix = [(layer.keys[:, :, :num_prefix], layer.values[:, :, :num_prefix]) for layer in cache.layers]
            return cache, logits, DynamicCache(ddp_cache_data=prefix)      # a copy: the cache concatenates
        prefix_cache, _ = self._forward(inputs.prefix_ids, self._new_cache(), inputs.vision, num_past=0)
        cache, logits = self._forward(inputs.suffix_ids, copy.deepcopy(prefix_cache), {}, num_past=num_prefix)
        return cache, logits, prefix_cache

    def _new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    def _forward(self, ids: torch.Tensor, cache: DynamicCache, vision: dict[str, torch.Tensor], *,
                 num_past: int, inputs_embeds: torch.Tensor | None = None) -> tuple[DynamicCache, torch.Tensor]:
        mask = torch.ones((1, num_past + ids.shape[1]), dtype=torch.long, device=ids.device)
        prompt = {"input_ids": ids} if inputs_embeds is None else {"inputs_embeds": inputs_embeds}
        with torch.inference_mode():
            out = self.model(**prompt, attention_mask=mask, cache=cache, use_cache=True, logits_to_keep=1,
                             **vision)
        return cache, out.logits[0, -1, :]


def merge_caches(caches: Sequence[DynamicCache]) -> tuple[DynamicCache, torch.Tensor]:
    """One cache for the batch, each row's keys/values left-padded to the longest, and the attention mask
    (rows, length) that hides the padding."""
    lengths = [c.get_seq_length() for c in caches]
    longest = max(lengths)
    layers = []
    for layer_index in range(len(caches[0].layers)):
        parts = [(c.layers[layer_index].keys, c.layers[layer_index].values) for c in caches]
        layers.append((_left_pad_cat([k for k, _ in parts], longest), _left_pad_cat([v for _, v in parts], longest)))
    device = layers[0][0].device
    mask = torch.zeros((len(caches), longest), dtype=torch.long, device=device)
    for row, length in enumerate(lengths):
        mask[row, longest - length:] = 1
    return DynamicCache(ddp_cache_data=layers), mask


def _left_pad_cat(tensors: list[torch.Tensor], length: int) -> torch.Tensor:
    """(1, heads, len_i, dim) tensors -> (rows, heads, length, dim), zeros on the left."""
    first = tensors[0]
    out = first.new_zeros((len(tensors), first.shape[1], length, first.shape[3]))
    for row, tensor in enumerate(tensors):
        out[row, :, length - tensor.shape[2]:] = tensor[0]
    return out


def can_merge_caches(model: Any) -> bool:
    """Whether rows of this model can be decoded together: its KV cache is plain attention layers that left
    padding can merge (no sliding window, no linear-attention state) and its positions are plain 1-D ones."""
    probe = DynamicCache(config=model.config)
    return has_plain_positions(model) and all(type(layer) is DynamicLayer for layer in probe.layers)


def has_plain_positions(model: Any) -> bool:
    """False for M-RoPE models (Qwen2-VL style), whose positions depend on the image grid and which keep
    position state between calls: neither a reused prefix nor explicit position ids are safe for them."""
    text_config = model.config.get_text_config(decoder=True)
    rope = getattr(text_config, "rope_scaling", None) or getattr(text_config, "rope_parameters", None) or {}
    return not (isinstance(rope, dict) and ("mrope_section" in rope or rope.get("type") == "mrope"))
