"""JSON-schema-constrained decoding with llguidance, as a transformers LogitsProcessor.

`SchemaGrammars` turns a schema into a compiled matcher once per (schema, tokenizer) and keeps it in a
small LRU (like TGI's cached compiled grammars); every request gets a fresh copy of that matcher.
`GrammarLogitsProcessor` masks each step's logits to the tokens the schema allows, consumes the sampled
tokens, and allows only EOS once the JSON value is complete. Whitespace between JSON tokens is not
flexible: a random (or confused) model given the choice emits whitespace forever.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from typing import Any, Sequence

import llguidance
import llguidance.hf
import torch
from transformers import LogitsProcessor

from inference_worker.protocol import ProtocolError

#: no flexible whitespace (forced over any "x-guidance" in the schema); keywords the engine lacks are
#: ignored rather than refused: the service validates every answer with jsonschema anyway.
JSON_OPTIONS = {"whitespace_flexible": False, "lenient": True}
DEFAULT_MAX_CACHED_SCHEMAS = 32


class GrammarError(ProtocolError):
    """A response_format schema the grammar engine cannot compile (HTTP 400, param response_format)."""

    def __init__(self, message: str):
        super().__init__(message, status=400, param="response_format")


class SchemaGrammars:
    """Compiles JSON schemas for one tokenizer and caches the compiled matchers.

    `vocab_size` is the model's lm_head width, which may exceed the tokenizer's size (padded vocabularies);
    `eos_token_ids` are the ids that end generation (generation_config.eos_token_id).
    """

    def __init__(self, tokenizer: Any, *, vocab_size: int, eos_token_ids: Sequence[int],
                 max_cached_schemas: int = DEFAULT_MAX_CACHED_SCHEMAS):
        if not eos_token_ids:
            raise ValueError("Constrained decoding needs the model's EOS token id; none is configured.")
        self.vocab_size = max(vocab_size, len(tokenizer))
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size,
                                                         eos_token=self.eos_token_ids)
        self.banned_token_ids = _special_token_ids(tokenizer, keep=self.eos_token_ids)
        self.max_cached_schemas = max_cached_schemas
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self.num_compiled = 0   # how many schemas were compiled (cache misses)

    def matcher(self, schema: dict[str, Any]) -> llguidance.LLMatcher:
        """A fresh matcher for `schema`, from the cache when this schema was seen before."""
        key = json.dumps(schema, sort_keys=True)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compile(schema)
            self._compiled[key] = compiled
            if len(self._compiled) > self.max_cached_schemas:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return compiled.deep_copy()

    def logits_processor(self, schema: dict[str, Any], batch_size: int = 1) -> "GrammarLogitsProcessor":
        """A new processor (one matcher per row) for one generate call."""
        return GrammarLogitsProcessor([self.matcher(schema) for _ in range(batch_size)],
                                      vocab_size=self.vocab_size, eos_token_id=self.eos_token_ids[0],
                                      banned_token_ids=self.banned_token_ids)

    def _compile(self, schema: dict[str, Any]) -> llguidance.LLMatcher:
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"response_format: the JSON schema is not valid JSON ({exc}).") from None
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"response_format: this JSON schema cannot be used for constrained output: "
                               f"{matcher.get_error()}")
        self.num_compiled += 1
        return matcher


class GrammarLogitsProcessor(LogitsProcessor):
    """Masks logits to what each row's matcher allows. Use one instance per generate call.

    Works whether generate starts from `input_ids` (the prompt is in input_ids) or from `inputs_embeds`
    (input_ids holds only generated tokens): from the second call on, the last column is the token just
    sampled, which the matcher consumes.
    """

    def __init__(self, matchers: list[llguidance.LLMatcher], *, vocab_size: int, eos_token_id: int,
                 banned_token_ids: Sequence[int] = ()):
        self.matchers = matchers
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.banned_token_ids = torch.tensor(sorted(banned_token_ids), dtype=torch.long)
        self.bitmask = torch.full((len(matchers), (vocab_size + 31) // 32), -1, dtype=torch.int32)
        self.num_steps = 0
        self.elapsed_s = 0.0      # time spent masking (the grammar's whole cost per generate call)
        self.errors: list[str] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        started = time.perf_counter()
        try:
            return self._mask(input_ids, scores)
        finally:
            self.elapsed_s += time.perf_counter() - started

    def _mask(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[0] != len(self.matchers):
            raise ValueError(f"GrammarLogitsProcessor has {len(self.matchers)} matchers for a batch of "
                             f"{input_ids.shape[0]} rows; make one processor per generate call.")
        if self.num_steps > 0:
            self._consume(input_ids[:, -1].tolist())
        self.num_steps += 1
        for row, matcher in enumerate(self.matchers):
            self._fill_row(row, matcher)
        allowed = unpack_bitmask(self.bitmask, scores.shape[-1]).to(scores.device)
        if len(self.banned_token_ids):
            banned = self.banned_token_ids[self.banned_token_ids < scores.shape[-1]].to(scores.device)
            allowed[:, banned] = False
        return scores.masked_fill(~allowed, float("-inf"))

    def is_complete(self, row: int = 0) -> bool:
        """True when row's output is a complete value of the schema."""
        return self.matchers[row].is_accepting()

    def _consume(self, token_ids: list[int]) -> None:
        for matcher, token_id in zip(self.matchers, token_ids):
            if matcher.is_stopped():      # finished rows get padding appended; ignore it
                continue
            if not matcher.consume_token(token_id):
                self.errors.append(matcher.get_error())

    def _fill_row(self, row: int, matcher: llguidance.LLMatcher) -> None:
        if matcher.is_stopped() or matcher.is_error():
            self.bitmask[row].zero_()                                # only EOS from here on
            self.bitmask[row, self.eos_token_id // 32] = _bit(self.eos_token_id % 32)
            return
        mask = self.bitmask[row]
        matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * mask.element_size())


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(rows, words) int32 bitmask, bit i of word w = token 32*w+i -> (rows, vocab_size) bool.

    Tokens past the mask's width (an lm_head wider than the tokenizer) come out disallowed.
    """
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    allowed = bits.reshape(bitmask.shape[0], -1).bool()
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    pad = torch.zeros(bitmask.shape[0], vocab_size - allowed.shape[1], dtype=torch.bool)
    return torch.cat([allowed, pad], dim=1)


def _bit(index: int) -> int:
    """The int32 word with only bit `index` set (two's complement for bit 31)."""
    return -(1 << 31) if index == 31 else 1 << index


def _special_token_ids(tokenizer: Any, *, keep: Sequence[int]) -> list[int]:
    """Ids of the tokenizer's special/added tokens, except `keep` (EOS): never valid inside JSON."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids.update(i for i, tok in decoder.items() if getattr(tok, "special", False))
    return sorted(i for i in ids if i not in set(keep))
