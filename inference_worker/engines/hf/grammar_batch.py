"""The grammar state of one batched decode: each row's llguidance matcher, masked and advanced step by step.

`GrammarBatch` holds the grammar state of the rows of one batched decode (their matchers come from grammar.py's
`SchemaGrammars`): the loop calls `apply` on each step's logits (each constrained row masked to the tokens its
schema allows; special tokens never; only EOS once the JSON value is complete) and `advance` with the sampled
tokens. `GrammarLogitsProcessor` adapts a `GrammarBatch` to transformers' generate (tests and benchmarks compare
the two).

Speed (benchmarks/grammar_mask.py): the banned special tokens are folded once into a packed "allowed words"
mask that is ANDed with llguidance's bitmask; the rows' masks are unpacked in one numpy call (or, for wide CPU
logits, applied 32 tokens at a time); a greedy row is masked only when the grammar refuses its argmax. With
`prefetch`, `advance` starts computing the next masks on a background thread (llguidance drops the GIL while
computing a mask) so that they can be ready when the model's forward returns; that thread only touches the
matchers, never the model. It is off by default: on 2 CPU cores the thread slows the forward more than it saves.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any, Protocol, Sequence

import llguidance
import numpy as np
import torch
from transformers import LogitsProcessor

from inference_worker.engines.hf.sampling import argmax_lines
from inference_worker.engines.hf.token_mask import BITS_PER_WORD, fill_banned_words, unpack_words


class TokenGrammars(Protocol):
    """What a batch needs of its compiler (grammar.SchemaGrammars): matchers, the packed token masks and the
    background thread that prefetches the next masks."""
    num_words: int
    eos_token_ids: list[int]
    banned_token_set: frozenset[int] | set[int]
    eos_only_words: np.ndarray
    allowed_words: np.ndarray
    executor: Any

    def matcher(self, schema: dict[str, Any]) -> llguidance.LLMatcher: ...

#: CPU logits at least this wide are masked a 32-token word at a time (fill_banned_words)
WORD_FILL_MIN_VOCAB = 16_384
#: a greedy row whose argmax the grammar refuses first tries this many next-best tokens (a few µs each) before
#: a whole mask is computed: the first one accepted is the masked argmax
NUM_GREEDY_CANDIDATES = 8


class GrammarBatch:
    """Grammar state for the rows of one batched decode: row i follows schemas[i] (None = unconstrained).

    Each step the decode loop calls `apply(logits, rows)` with the logits of the rows still running (distinct
    batch row numbers, line j of logits being row rows[j]), samples, then `advance(rows, token_ids)`. Passing
    `greedy` to apply skips the mask of a greedy row whose argmax the grammar accepts; `accepts` lets a
    sampler do the same. One thread (the model thread) calls these; with `prefetch` the next masks are
    computed on the grammars' background thread between `advance` and the next `apply`.
    `elapsed_s` is the time the calling thread spent in the grammar (waiting for a prefetch included).
    """

    def __init__(self, grammars: TokenGrammars, schemas: Sequence[dict[str, Any] | None], *,
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
