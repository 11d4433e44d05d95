"""What the Hugging Face engines share: a model decoded by the continuous `BatchDecoder`, a grammar compiler, prompt
bounds, a frame cache, and the way a decoded row becomes a `Completion`.

An engine built on `DecodingEngine` writes only what differs: `_encode` (a request's images and preprocessed
inputs, off the model thread) and `_decoder_rows` (prepared requests to the decoder's rows, on the model thread).
The rest of the Engine contract is here: `prepare` checks the prompt's length before and after encoding and
compiles the request's schema; `run_batch` numbers the rows, hands them (and the ones `take_more` brings while
decoding) to the decoder and answers each as it ends; `stats`, `after_call` and `close`.
"""

from __future__ import annotations

import itertools
import logging
import threading
from abc import abstractmethod
from typing import TYPE_CHECKING, Any, Callable, Sequence

from inference_worker.engines.base import Engine, EngineStats, OnDone, Prepared, TakeMoreItems
from inference_worker.engines.hf.batch_decode import BatchDecoder, can_merge_caches
from inference_worker.engines.hf.grammar import GrammarCompiler
from inference_worker.engines.hf.rows import PromptInputs, Row, RowResult
from inference_worker.engines.hf.sampling import finish_reason, trim_at_eos
from inference_worker.engines.hf.special_tokens import escaper_for
from inference_worker.engines.hf.text_stream import text_stream
from inference_worker.engines.hf.torch_utils import apply_num_threads, release_cuda_cache
from inference_worker.engines.options import EngineOptions
from inference_worker.engines.prompt_bounds import PromptBounds, context_tokens_of
from inference_worker.protocol import ChatRequest, Completion, CompletionFacts, Timing

if TYPE_CHECKING:
    from PIL.Image import Image

    from inference_worker.engines.hf.frame_cache import FrameCache

log = logging.getLogger("inference_worker")

#: a row the model could not take (its inputs would not move to the device, its images would not embed):
#: (its index in the batch, the exception) -> answered alone
FailRow = Callable[[int, Exception], None]


class DecodingEngine(Engine):
    """A vision-language model behind the continuous batch decoder. `language_model` is what the decoder runs (the
    model itself, or the inner LM of an engine that embeds images itself); `frame_cache` is what `stats` reports and
    `close` clears, handed to the decoder only where it holds prefix KV (`holds_prefix_kv`)."""

    can_batch = True

    def __init__(self, model: Any, processor: Any, *, model_name: str, options: EngineOptions, language_model: Any,
                 eos_token_ids: Sequence[int], frame_cache: "FrameCache | None", holds_prefix_kv: bool,
                 can_prefill_together: bool = False):
        self.model = model
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.model_name = model_name
        self.num_threads = options.num_threads
        self.image_limits = options.image_limits
        self.eos_token_ids = list(eos_token_ids)
        #: request text -> text the processor and tokenizer read as text only (see special_tokens.py)
        self.escape_text = escaper_for(self.tokenizer, processor)
        self.frame_cache = frame_cache
        #: the longest prompt `prepare` lets through: the model's context, or less (--max-prompt-tokens)
        self.bounds = PromptBounds(context_tokens_of(language_model.config), options.max_prompt_tokens)
        #: compiled for every row of the lm_head, which may be wider than the tokenizer (a padded vocabulary)
        self.grammars = GrammarCompiler(self.tokenizer, eos_token_ids=self.eos_token_ids,
                                        vocab_size=language_model.get_output_embeddings().weight.shape[0],
                                        is_enabled=options.use_grammar)
        self.decoder = BatchDecoder(language_model, eos_token_ids=self.eos_token_ids,
                                    frame_cache=frame_cache if holds_prefix_kv else None, grammars=self.grammars,
                                    can_merge=can_merge_caches(language_model),
                                    can_prefill_together=can_prefill_together,
                                    max_context_tokens=self.bounds.context_tokens)

    @property
    def device(self) -> Any:
        return self.model.device

    # ------------------------------------------------------------ what each engine writes

    @abstractmethod
    def _encode(self, request: ChatRequest, cancelled: threading.Event) -> tuple[list["Image"], Any]:
        """The request's decoded images (empty where another process decoded them) and its inputs: an object with
        `num_tokens` and a `grammar` slot. Runs on a preprocessing thread; must not call the model."""

    @abstractmethod
    def _decoder_rows(self, items: list[tuple[int, Prepared]], fail: FailRow) -> list[tuple[int, Row]]:
        """The decoder's (index, Row) for each prepared item (model thread); an item that cannot become a row is
        handed to `fail` and left out."""

    # ------------------------------------------------------------ the contract

    def prepare(self, request: ChatRequest, cancelled: threading.Event | None = None) -> Prepared:
        """Images and the engine's preprocessing, then the grammar; runs on a preprocessing thread. A prompt longer
        than `bounds` allow is refused (PromptTooLongError: its text before the template and tokenizer run, then its
        tokens); a schema the grammar cannot compile is refused (GrammarError)."""
        cancelled = cancelled if cancelled is not None else threading.Event()
        self.bounds.check_text(request)
        images, inputs = self._encode(request, cancelled)
        self.bounds.check_tokens(inputs.num_tokens, request)
        inputs.grammar = self.grammars.matcher_for(request)
        return Prepared(request, images, inputs, cancelled=cancelled)

    def run_batch(self, items: Sequence[Prepared], on_done: OnDone, take_more: TakeMoreItems | None = None) -> None:
        """Decode `items` and, between steps, the items `take_more(num_live)` hands over; those are numbered
        after `items`, in the order handed over. A row the model cannot take fails alone."""
        apply_num_threads(self.num_threads)
        numbers = itertools.count()

        def rows_of(batch: Sequence[Prepared]) -> list[tuple[int, Row]]:
            return self._decoder_rows([(next(numbers), item) for item in batch],
                                      lambda index, exc: _answer(on_done, index, exc))

        def done(index: int, result: RowResult | Exception) -> None:
            on_done(index, result if isinstance(result, Exception) else self._completion(result))

        first = rows_of(items)
        more = None if take_more is None else (lambda num_live: rows_of(take_more(num_live)))
        self.decoder.run_indexed(first, done, more)

    def stats(self) -> EngineStats:
        cache, decoder = self.frame_cache, self.decoder
        decoding = {} if decoder is None else dict(live_rows=decoder.live_rows, num_decode_steps=decoder.num_steps,
                                                   num_row_steps=decoder.num_row_steps)
        kv = {} if cache is None else dict(kv_bytes=cache.num_bytes, kv_entries=cache.num_entries,
                                           kv_evictions=cache.num_evictions)
        return EngineStats(num_cuda_empty_cache_calls=self.num_cuda_empty_cache_calls, **decoding, **kv)

    def after_call(self) -> None:
        self.num_cuda_empty_cache_calls += release_cuda_cache()

    def close(self) -> None:
        self.model = self.decoder = None
        self.grammars.close()
        if self.frame_cache is not None:
            self.frame_cache.clear()
        self.num_cuda_empty_cache_calls += release_cuda_cache()

    # ------------------------------------------------------------ helpers

    def _row(self, item: Prepared, prompt: PromptInputs) -> Row:
        """The decoder's row for one attempt at `item`: its prompt (on the device), a fresh copy of the compiled
        grammar, its sampling, the client's cancel event and its text stream."""
        grammar = item.inputs.grammar
        return Row(prompt, item.request.sampling, None if grammar is None else grammar.deep_copy(), item.cancelled,
                   on_token=text_stream(self.tokenizer, self.eos_token_ids, item.on_text))

    def _completion(self, result: RowResult) -> Completion:
        token_ids, is_eos = trim_at_eos(result.token_ids, self.eos_token_ids)
        return Completion(text=self.tokenizer.decode(token_ids, skip_special_tokens=True),
                          finish_reason=finish_reason(is_eos), prompt_tokens=result.prompt_tokens,
                          completion_tokens=len(token_ids), facts=row_facts(result))


def row_facts(result: RowResult) -> CompletionFacts:
    """What the decoder measured for one row, as the answer's facts (milliseconds rounded to the microsecond)."""
    return CompletionFacts(
        cache=result.kv_cache, constrained=result.is_constrained, batch_size=result.batch_size,
        grammar_ms=_ms(result.grammar_s) if result.is_constrained else None,
        mean_live_rows=round(result.mean_live_rows, 2), logits=result.logits,
        timing=Timing(ttft_ms=_ms(result.ttft_s), decode_ms=_ms(result.decode_s),
                      vision_ms=_ms(result.vision_s) if result.vision_s else None))   # its part of ttft_ms


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def _answer(on_done: OnDone, index: int, answer: "Completion | Exception") -> None:
    """on_done for one row; a callback that raises is that row's problem, not its neighbours'."""
    try:
        on_done(index, answer)
    except Exception:  # noqa: BLE001
        log.exception("the completion callback of batch row %d failed; the other rows go on", index)
