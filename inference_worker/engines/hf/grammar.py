"""JSON-schema-constrained decoding with llguidance: compiling a request's schema into a matcher.

`GrammarCompiler` is every engine's one way to its grammars (the Transformers and MiniCPM-o engines, and OpenVINO):
it makes the tokenizer's `SchemaGrammars` on first use and turns a request's `json_schema` into a compiled matcher
while the request is prepared. `SchemaGrammars` compiles a schema once per (schema, tokenizer) and keeps it in a
small LRU (like TGI's cached compiled grammars); every request gets a fresh copy of that matcher. What a decode
does with the matchers, step by step, is grammar_batch.py.

Whitespace between JSON tokens is not flexible: a random (or confused) model given the choice emits
whitespace forever.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Sequence

import llguidance
import llguidance.hf

from inference_worker.engines.hf.grammar_batch import GrammarBatch, GrammarLogitsProcessor
from inference_worker.engines.hf.token_mask import BITS_PER_WORD, pack_token_ids
from inference_worker.protocol import ProtocolError

if TYPE_CHECKING:
    from inference_worker.protocol import ChatRequest

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

    def batch(self, schemas: Sequence[dict[str, Any] | None], *, prefetch: bool = False) -> GrammarBatch:
        """Grammar state for one batched decode; row i follows schemas[i] (None: unconstrained)."""
        return GrammarBatch(self, schemas, prefetch=prefetch)

    def logits_processor(self, schema: dict[str, Any], batch_size: int = 1) -> GrammarLogitsProcessor:
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


class GrammarCompiler:
    """One engine's grammars: its tokenizer's `SchemaGrammars`, made on first use (seconds at a 248k vocabulary,
    paid only once a request brings a schema) by whichever preprocessing thread needs it first, hence the lock.
    Calling it returns the SchemaGrammars (the batch decoder's `grammars`); `matcher_for` compiles a request's
    schema while it is prepared. With `is_enabled` False (--no-grammar) every request decodes free text.

    `vocab_size` is the model's lm_head width, which may exceed the tokenizer's size (padded vocabularies)."""

    def __init__(self, tokenizer: Any, *, vocab_size: int, eos_token_ids: Sequence[int], is_enabled: bool = True):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.is_enabled = is_enabled
        self._grammars: SchemaGrammars | None = None
        self._lock = threading.Lock()

    def __call__(self) -> SchemaGrammars:
        with self._lock:
            if self._grammars is None:
                self._grammars = SchemaGrammars(self.tokenizer, vocab_size=self.vocab_size,
                                                eos_token_ids=self.eos_token_ids)
            return self._grammars

    def matcher_for(self, request: "ChatRequest") -> llguidance.LLMatcher | None:
        """A fresh matcher for the request's schema; None without a schema or with grammars off. A schema
        llguidance refuses raises GrammarError: that request's 400, its neighbours unaffected."""
        if request.json_schema is None or not self.is_enabled:
            return None
        return self().matcher(request.json_schema)

    def close(self) -> None:
        """Stop the prefetch thread and drop the compiled schemas (a later request compiles them again)."""
        with self._lock:
            grammars, self._grammars = self._grammars, None
        if grammars is not None:
            grammars.close()


def _special_token_ids(tokenizer: Any, *, keep: Sequence[int]) -> list[int]:
    """Ids of the tokenizer's special/added tokens, except `keep` (EOS): never valid inside JSON."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids.update(i for i, tok in decoder.items() if getattr(tok, "special", False))
    return sorted(i for i in ids if i not in set(keep))
