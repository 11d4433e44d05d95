"""JSON-schema-constrained decoding with llguidance: per-row grammar state for a batched decode loop.

`SchemaGrammars` turns a schema into a compiled matcher once per (schema, tokenizer) and keeps it in a
small LRU (like TGI's cached compiled grammars); every request gets a fresh copy of that matcher.
`GrammarBatch` holds the grammar state of the rows of one batched decode: the loop calls `apply` on each
step's logits (each constrained row masked to the tokens its schema allows; special tokens never; only EOS
once the JSON value is complete) and `advance` with the sampled tokens. `GrammarLogitsProcessor` adapts a
`GrammarBatch` to transformers' generate (used by engines that still call generate).

Whitespace between JSON tokens is not flexible: a random (or confused) model given the choice emits
whitespace forever.

Speed (benchmarks/grammar_mask.py): the banned special tokens are folded once into a packed "allowed words"
mask that is ANDed with llguidance's bitmask; the rows' masks are unpacked in one numpy call (or, for wide CPU
logits, applied 32 tokens at a time); a greedy row is masked only when the grammar refuses its argmax. With
`prefetch`, `advance` starts computing the next masks on a background thread (llguidance drops the GIL while
computing a mask) so that they can be ready when the model's forward returns; that thread only touches the
matchers, never the model. It is off by default: on 2 CPU cores the thread slows the forward more than it saves.
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence

import llguidance
import llguidance.hf
import numpy as np
import torch
from transformers import LogitsProcessor

from inference_worker.engines.hf.sampling import argmax_lines
from inference_worker.engines.hf.token_mask import BITS_PER_WORD, fill_banned_words, pack_token_ids, unpack_words
from inference_worker.protocol import ProtocolError

#: no flexible whitespace (forced over any "x-guidance" in the schema); keywords the engine lacks are
#: ignored rather than refused: the service validates every answer with jsonschema anyway.
JSON_OPTIONS = {"whitespace_flexible": False, "lenient": True}
DEFAULT_MAX_CACHED_SCHEMAS = 32
#: CPU logits at least this wide are masked a 32-token word at a time (fill_banned_words)
WORD_FILL_MIN_VOCAB = 16_384
#: a greedy row whose argmax the grammar refuses first tries this many next-best tokens (a few µs each) before
#: a whole mask is computed: the first one accepted is the masked argmax
NUM_GREEDY_CANDIDATES = 8


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
        self.num_words = -(-self.vocab_size // BITS_PER_WORD)
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size,
                                                         eos_token=self.eos_token_ids)
        self.banned_token_ids = _special_token_ids(tokenizer, keep=self.eos_token_ids)
        self.banned_token_set = frozenset(self.banned_token_ids)
        #: packed masks ANDed with the matcher's: every token but the banned ones / only the first EOS
        self.allowed_words = pack_token_ids(self.vocab_size, self.banned_token_ids, allowed=False)
        self.eos_only_words = pack_token_ids(self.vocab_size, self.eos_token_ids[:1], allowed=True)
        self.max_cached_schemas = max_cached_schemas
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._cache_lock = threading.Lock()
        self.num_compiled = 0   # how many schemas were compiled (cache misses)
        self._executor: ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()

    def matcher(self, schema: dict[str, Any]) -> llguidance.LLMatcher:
        """A fresh matcher for `schema`, from the cache when this schema was seen before. Thread safe (the
        preprocessing threads compile while the model thread decodes); raises GrammarError for a schema
        llguidance refuses."""
        key = json.dumps(schema, sort_keys=True)
        with self._cache_lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                return compiled.deep_copy()
        compiled = self._compile(schema)                   # outside the lock: a slow schema delays no one else
        with self._cache_lock:
            self._compiled[key] = compiled
            if len(self._compiled) > self.max_cached_schemas:
                self._compiled.popitem(last=False)
        return compiled.deep_copy()

    def batch(self, schemas: Sequence[dict[str, Any] | None], *, prefetch: bool = False) -> "GrammarBatch":
        """Grammar state for one batched decode; row i follows schemas[i] (None: unconstrained)."""
        return GrammarBatch(self, schemas, prefetch=prefetch)

    def logits_processor(self, schema: dict[str, Any], batch_size: int = 1) -> "GrammarLogitsProcessor":
        """A new processor (every row following `schema`) for one generate call."""
        return GrammarLogitsProcessor(self.batch([schema] * batch_size))

    @property
    def executor(self) -> ThreadPoolExecutor:
        """The one background thread that prefetches masks; started on first use, stopped by `close`."""
        with self._executor_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deskeye-grammar")
                weakref.finalize(self, self._executor.shutdown, wait=False)
            return self._executor

    def close(self) -> None:
        """Stop the prefetch thread (after its current mask). The cache stays usable; a later prefetch restarts it."""
        with self._executor_lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    def _compile(self, schema: dict[str, Any]) -> llguidance.LLMatcher:
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"response_format: the JSON schema is not valid JSON ({exc}).") from None
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"response_format: this JSON schema cannot be used for constrained output: "
                               f"{matcher.get_error()}")
        with self._cache_lock:
            self.num_compiled += 1
        return matcher


class GrammarBatch:
    """Grammar state for the rows of one batched decode: row i follows schemas[i] (None = unconstrained).

    Each step the decode loop calls `apply(logits, rows)` with the logits of the rows still running (distinct
    batch row numbers, line j of logits being row rows[j]), samples, then `advance(rows, token_ids)`. Passing
    `greedy` to apply skips the mask of a greedy row whose argmax the grammar accepts; `accepts` lets a
    sampler do the same. One thread (the model thread) calls these; with `prefetch` the next masks are
    computed on the grammars' background thread between `advance` and the next `apply`.
    `elapsed_s` is the time the calling thread spent in the grammar (waiting for a prefetch included).
    """

    def __init__(self, grammars: SchemaGrammars, schemas: Sequence[dict[str, Any] | None], *,
                 prefetch: bool = False):
        self.grammars = grammars
        self.matchers: list[llguidance.LLMatcher | None] = []
        self.prefetch = prefetch
        self.is_constrained: list[bool] = []
        #: per row, the tokens it may sample, packed: the matcher's mask AND grammars.allowed_words;
        #: all ones for an unconstrained row
        self._allowed = np.full((0, grammars.num_words), -1, dtype=np.int32)
        self._is_fresh: list[bool] = []          # is _allowed[row] the row's current mask?
        self._pending: Future | None = None
        self._row_elapsed_s: list[float] = []
        self._free_rows: list[int] = []          # rows released, to be reused by `add`
        self.elapsed_s = 0.0
        self.num_steps = 0
        self.num_prefetched = 0      # masks computed on the prefetch thread
        self.errors: list[str] = []
        for schema in schemas:
            self.add(None if schema is None else grammars.matcher(schema))

    def add(self, matcher: llguidance.LLMatcher | None) -> int:
        """A row for a request joining the decode (None: unconstrained); returns its row number. Rows freed by
        `release` are reused, so a decode that never stops holds only as many rows as it ever had live."""
        self._wait()                             # a prefetch writes into _allowed, which may be reallocated here
        if self._free_rows:
            row = self._free_rows.pop()
        else:
            row = len(self.matchers)
            self.matchers.append(None)
            self.is_constrained.append(False)
            self._is_fresh.append(True)
            self._row_elapsed_s.append(0.0)
            self._allowed = np.concatenate([self._allowed, np.full((1, self.grammars.num_words), -1, np.int32)])
        self.matchers[row] = matcher
        self.is_constrained[row] = matcher is not None
        self._is_fresh[row] = matcher is None
        self._allowed[row] = -1
        self._row_elapsed_s[row] = 0.0
        return row

    def release(self, row: int) -> None:
        """The row left the decode: forget its matcher; `add` may reuse the row."""
        self._wait()
        self.matchers[row] = None
        self.is_constrained[row] = False
        self._is_fresh[row] = True
        self._free_rows.append(row)

    def __len__(self) -> int:
        return len(self.matchers)

    # ------------------------------------------------------------ the decode loop's calls

    def apply(self, logits: torch.Tensor, rows: Sequence[int], *,
              greedy: Sequence[bool] | None = None) -> list[int] | None:
        """In place: masks logits (one line per entry of `rows`, in that order) to what each row allows.

        `greedy[j]` True says line j will be decoded by argmax: it is then masked only when the grammar refuses
        its unmasked argmax, which otherwise already is the masked argmax (same token, and no mask to compute:
        the common case for a model that writes JSON). Its other logits are then left unmasked. With `greedy`,
        returns every line's argmax after masking (computed anyway; at 150k tokens it is not cheap).
        `logits` may be an inference tensor (a forward's output under torch.inference_mode)."""
        started = time.perf_counter()
        argmax = None if greedy is None else argmax_lines(logits)
        if any(self.is_constrained[row] for row in rows):
            self._wait()
            masked = None if greedy is None else self._needs_mask(rows, argmax, greedy)
            if masked is not None and any(masked):
                self._try_next_best(logits, rows, argmax, greedy, masked)
            if masked is None or any(masked):
                self._mask(logits, self._banned_words(rows, masked), rows)
                if greedy is not None:               # lines left unmasked keep the token picked for them
                    argmax = [new if is_masked else old
                              for new, old, is_masked in zip(argmax_lines(logits), argmax, masked)]
        self._charge(rows, started)
        return argmax

    def advance(self, rows: Sequence[int], token_ids: Sequence[int] | torch.Tensor) -> None:
        """Consume the token each of `rows` just sampled; with prefetch, start computing their next masks."""
        started = time.perf_counter()
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.tolist()
        if len(rows) != len(token_ids):
            raise ValueError(f"advance got {len(token_ids)} tokens for {len(rows)} rows.")
        self._wait()
        consumed = [row for row, token_id in zip(rows, token_ids) if self._consume(row, token_id)]
        self.num_steps += 1
        if self.prefetch and consumed:
            self._pending = self.grammars.executor.submit(self._prefetch, consumed)
        self._charge(rows, started)

    def accepts(self, row: int, token_id: int) -> bool:
        """Would the row's mask allow `token_id`? Checked without computing the mask (a few µs): a sampler
        may draw from unmasked logits first and mask only on a refusal, which is exact for argmax and for
        plain temperature sampling (rejection sampling), not after top-k/top-p."""
        self._wait()
        matcher = self.matchers[row]
        if matcher is None:
            return True
        if matcher.is_stopped():
            return token_id == self.grammars.eos_token_ids[0]
        return token_id not in self.grammars.banned_token_set and matcher.validate_tokens([token_id]) == 1

    def is_accepting(self, row: int) -> bool:
        """True when the row's output so far is a complete value of its schema (always, unconstrained)."""
        self._wait()
        matcher = self.matchers[row]
        return matcher is None or matcher.is_accepting()

    def elapsed_s_for(self, row: int) -> float:
        """The row's share of `elapsed_s`: each call's time split evenly between its constrained rows."""
        return self._row_elapsed_s[row]

    def close(self) -> None:
        """Wait for a running prefetch; call when the decode ends early (an error) before dropping the batch."""
        self._wait()

    # ------------------------------------------------------------ masks

    def disallowed(self, rows: Sequence[int], width: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """(len(rows), width) bool on `device`: True where a row may not sample the token."""
        started = time.perf_counter()
        banned = self._banned_bits(self._banned_words(rows), rows, width).to(device)
        self._charge(rows, started)
        return banned

    def _mask(self, logits: torch.Tensor, banned_words: np.ndarray, rows: Sequence[int]) -> None:
        if logits.is_inference() and not torch.is_inference_mode_enabled():
            with torch.inference_mode():                  # costs ~40 µs: call apply inside inference_mode
                self._mask(logits, banned_words, rows)
        elif (logits.is_cpu and logits.shape[-1] >= WORD_FILL_MIN_VOCAB and logits.is_contiguous()
                and logits.shape[-1] == banned_words.shape[1] * BITS_PER_WORD):
            fill_banned_words(logits, banned_words)
        else:
            banned = self._banned_bits(banned_words, rows, logits.shape[-1])
            logits.masked_fill_(banned.to(logits.device), float("-inf"))

    def _banned_words(self, rows: Sequence[int], masked: list[bool] | None = None) -> np.ndarray:
        """(len(rows), num_words) int32, packed: a bit is set where the row may not sample the token;
        no bit at all in the lines that `masked` says to leave alone."""
        self._wait()
        stale = [row for j, row in enumerate(rows) if not self._is_fresh[row] and (masked is None or masked[j])]
        if stale:
            self._fill(stale)
        if len(rows) == 1:                                   # a slice: cheaper than take, the common case
            words = np.invert(self._allowed[rows[0]:rows[0] + 1])
        else:
            words = np.invert(self._allowed.take(rows, axis=0))
        if masked is not None:
            words[~np.asarray(masked)] = 0
        return words

    def _try_next_best(self, logits: torch.Tensor, rows: Sequence[int], argmax: list[int], greedy: Sequence[bool],
                       masked: list[bool]) -> None:
        """For greedy lines still needing a mask: the most likely of the next NUM_GREEDY_CANDIDATES tokens that
        the grammar accepts is the masked argmax (ties aside), so that line needs no mask (updated in place)."""
        for j, row in enumerate(rows):
            if not (masked[j] and greedy[j]):
                continue
            candidates = torch.topk(logits[j], min(NUM_GREEDY_CANDIDATES, logits.shape[-1])).indices.tolist()
            accepted = next((t for t in candidates if self.accepts(row, t)), None)
            if accepted is not None:
                argmax[j], masked[j] = accepted, False

    def _needs_mask(self, rows: Sequence[int], argmax: list[int], greedy: Sequence[bool]) -> list[bool]:
        """Per line: False for an unconstrained row, and for a greedy row whose argmax its grammar accepts."""
        return [self.is_constrained[row] and not (is_greedy and self.accepts(row, token))
                for row, token, is_greedy in zip(rows, argmax, greedy)]

    def _banned_bits(self, banned_words: np.ndarray, rows: Sequence[int], width: int) -> torch.Tensor:
        """Unpacked to (len(rows), width) bool on the CPU; tokens past the mask are banned in constrained rows."""
        banned = unpack_words(banned_words, width)
        num_bits = banned_words.shape[1] * BITS_PER_WORD
        if width > num_bits:                                 # logits wider than the mask: tokens no row has
            banned[:, num_bits:] = np.asarray([self.is_constrained[row] for row in rows])[:, None]
        return torch.from_numpy(banned)

    def _fill(self, rows: list[int]) -> None:
        """Compute the current mask of each of `rows` (the prefetch thread runs this too)."""
        row_bytes = self._allowed.shape[1] * self._allowed.itemsize
        base = self._allowed.ctypes.data
        for row in rows:
            matcher, words = self.matchers[row], self._allowed[row]
            if matcher.is_stopped():              # complete, or in error: only EOS from here on
                words[:] = self.grammars.eos_only_words
            else:
                matcher.unsafe_compute_mask_ptr(base + row * row_bytes, row_bytes)
                np.bitwise_and(words, self.grammars.allowed_words, out=words)    # never a special token
            self._is_fresh[row] = True

    def _prefetch(self, rows: list[int]) -> None:
        self._fill(rows)
        self.num_prefetched += len(rows)

    def _consume(self, row: int, token_id: int) -> bool:
        """Feed one sampled token to the row's matcher; True when its mask changed (needs recomputing)."""
        matcher = self.matchers[row]
        if matcher is None or matcher.is_stopped():    # finished rows may get padding appended; ignore it
            return False
        if not matcher.consume_token(token_id):
            self.errors.append(f"row {row}: {matcher.get_error()}")
        self._is_fresh[row] = False
        return True

    def _wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _charge(self, rows: Sequence[int], started: float) -> None:
        elapsed_s = time.perf_counter() - started
        self.elapsed_s += elapsed_s
        constrained = [row for row in rows if self.is_constrained[row]]
        for row in constrained:
            self._row_elapsed_s[row] += elapsed_s / len(constrained)


class GrammarLogitsProcessor(LogitsProcessor):
    """A `GrammarBatch` as a transformers LogitsProcessor (all rows of the generate call). One per call.

    Works whether generate starts from `input_ids` (the prompt is in input_ids) or from `inputs_embeds`
    (input_ids holds only generated tokens): from the second call on, the last column is the token just
    sampled, which the matchers consume.
    """

    def __init__(self, batch: GrammarBatch):
        self.batch = batch
        self.rows = list(range(len(batch)))
        self.num_calls = 0

    @property
    def elapsed_s(self) -> float:
        """Time spent masking (the grammar's whole cost per generate call)."""
        return self.batch.elapsed_s

    @property
    def errors(self) -> list[str]:
        return self.batch.errors

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[0] != len(self.rows):
            raise ValueError(f"GrammarLogitsProcessor has {len(self.rows)} rows for a batch of "
                             f"{input_ids.shape[0]} rows; make one processor per generate call.")
        if self.num_calls > 0:
            self.batch.advance(self.rows, input_ids[:, -1])
        self.num_calls += 1
        # out of place: generate may keep the raw logits it passes here (output_logits)
        return scores.masked_fill(self.batch.disallowed(self.rows, scores.shape[-1], scores.device), float("-inf"))

    def is_complete(self, row: int = 0) -> bool:
        """True when row's output is a complete value of the schema."""
        return self.batch.is_accepting(row)


def _special_token_ids(tokenizer: Any, *, keep: Sequence[int]) -> list[int]:
    """Ids of the tokenizer's special/added tokens, except `keep` (EOS): never valid inside JSON."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids.update(i for i, tok in decoder.items() if getattr(tok, "special", False))
    return sorted(i for i in ids if i not in set(keep))
