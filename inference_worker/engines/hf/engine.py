"""The vision-language model engine for families transformers supports natively (Idefics3, LLaVA,
MiniCPM-V 4.6, …): chat template, processor, grammar compile and frame keys (`prepare`, on a preprocessing
thread), then continuous batched decoding with frame KV reuse and JSON-schema-constrained output (`run_batch`, on
the model thread; batch_decode.py), into which requests that arrive meanwhile join through `take_more`.
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import TYPE_CHECKING, Any, Sequence

import torch

from inference_worker.config import DEFAULT_MAX_IMAGE_PIXELS
from inference_worker.engines.base import Engine, EngineStats, OnDone, Prepared, TakeMoreItems, run_one
from inference_worker.engines.hf.batch_decode import BatchDecoder, can_merge_caches, has_plain_positions
from inference_worker.engines.hf.loading import LoadedModel
from inference_worker.engines.hf.preprocess import PrepareProcessDied, Preprocessor, image_token_id
from inference_worker.engines.hf.rows import PromptInputs, Row, RowResult
from inference_worker.engines.hf.sampling import eos_token_ids, finish_reason, trim_at_eos
from inference_worker.engines.hf.special_tokens import escaper_for
from inference_worker.engines.hf.text_stream import text_stream
from inference_worker.engines.hf.torch_utils import apply_num_threads, release_cuda_cache
from inference_worker.engines.prompt_bounds import PromptBounds, context_tokens_of
from inference_worker.errors import one_line
from inference_worker.protocol import ChatRequest, Completion

if TYPE_CHECKING:
    from PIL.Image import Image

    from inference_worker.engines.hf.grammar import SchemaGrammars
    from inference_worker.engines.hf.preprocess import PrepareProcesses


log = logging.getLogger("deskeye.worker")

#: model_types whose processor outputs one batch row per prompt (pixel_values (1, ...)) that stack along the batch;
#: MiniCPM-V packs every image's patches into one row (NaViT): packed_images.PACKED_IMAGE_FAMILIES
STACKABLE_IMAGE_FAMILIES = ("idefics3", "smolvlm", "llava")


class TransformersEngine(Engine):
    kind = "transformers"
    can_batch = True

    def __init__(self, model: Any, processor: Any, *, model_name: str, use_grammar: bool = True,
                 num_threads: int | None = None, kv_cache_bytes: int = 0, kv_similar_threshold: float | None = None,
                 keep_logits: bool = False, max_prompt_tokens: int = 0):
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"num_threads must be at least 1 (or None for torch's default); got {num_threads}.")
        self.model = model
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.model_name = model_name
        self.use_grammar = use_grammar
        self.num_threads = num_threads
        self.eos_token_ids = eos_token_ids(model.generation_config, self.tokenizer)
        self.image_token_id = image_token_id(model.config, self.tokenizer, processor)
        self.grammars: SchemaGrammars | None = None
        self._grammars_lock = threading.Lock()
        #: request text -> text the processor and tokenizer read as text only (see special_tokens.py)
        self.escape_text = escaper_for(self.tokenizer, processor)
        self.frame_cache = _frame_cache(kv_cache_bytes if has_plain_positions(model) else 0, kv_similar_threshold)
        self.preprocessor = Preprocessor(processor, self.image_token_id, model_name,
                                         with_frame_keys=self.frame_cache is not None, escape_text=self.escape_text)
        self._processes: PrepareProcesses | None = None
        self.max_image_pixels = 0         # the service's limit, which the processes apply (set when they start)
        #: the longest prompt `prepare` lets through: the model's context, or less (--max-prompt-tokens)
        self.bounds = PromptBounds(context_tokens_of(model.config), max_prompt_tokens)
        self.decoder = BatchDecoder(model, eos_token_ids=self.eos_token_ids, frame_cache=self.frame_cache,
                                    grammars=self._schema_grammars, can_merge=can_merge_caches(model),
                                    can_prefill_together=can_prefill_together(model), keep_logits=keep_logits,
                                    max_context_tokens=self.bounds.context_tokens)

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, **options: Any) -> "TransformersEngine":
        return cls(loaded.model, loaded.processor, model_name=loaded.name, **options)

    @property
    def device(self) -> torch.device:
        return self.model.device

    # ------------------------------------------------------------ the contract

    @property
    def decodes_images(self) -> bool:
        """True while preprocessing processes run: they decode the request's images themselves."""
        return self._processes is not None

    def prepare(self, request: ChatRequest, images: list["Image"] | None) -> Prepared:
        """Images, template, processor and frame keys (in a preprocessing process when there are some), then the
        grammar and the similar-frame search; runs on a preprocessing thread. A prompt longer than `bounds` allow
        is refused (PromptTooLongError: its text before the template and tokenizer run, then its tokens)."""
        self.bounds.check_text(request)
        inputs = self._encode(request, images)
        self.bounds.check_tokens(inputs.num_tokens, request)
        if request.json_schema is not None and self.use_grammar:
            inputs.grammar = self._schema_grammars().matcher(request.json_schema)   # GrammarError: this row's 400
        if inputs.frame is not None:
            inputs.frame.nearest = self.frame_cache.nearest(inputs.frame.group_key, inputs.frame.signature)
        return Prepared(request, images or [], inputs)

    def start_prepare_processes(self, num_processes: int, max_image_pixels: int) -> None:
        """Decode images and run the processor in `num_processes` child processes from now on (preprocess.py
        says why); returns once each has encoded a warm-up request."""
        from inference_worker.engines.hf.preprocess import PrepareProcesses, warm_up_request
        self.max_image_pixels = max_image_pixels
        try:
            self._processes = PrepareProcesses(self.preprocessor, num_processes, max_image_pixels=max_image_pixels,
                                               warm_up=warm_up_request())
        except Exception as exc:  # noqa: BLE001 - e.g. a processor that cannot be pickled: threads still serve
            log.warning("--prepare-processes %d: cannot prepare in child processes (%s); preprocessing stays on "
                        "the worker's threads", num_processes, one_line(exc))
            return
        log.info("preprocessing in %d process(es): pid %s", num_processes, ", ".join(map(str, self._processes.pids)))

    def _encode(self, request: ChatRequest, images: list["Image"] | None) -> PromptInputs:
        """`images` None: the request's images are still to decode (the service left it to the processes)."""
        processes = self._processes
        if processes is not None:
            try:
                inputs = processes.try_encode(request)
                if inputs is not None:
                    return inputs
            except PrepareProcessDied as exc:
                log.warning("a preprocessing process died (%s); preprocessing goes on in the worker's threads", exc)
                self._processes = None
                processes.close()
        if images is None:
            from inference_worker.serving.images import decode_request_images
            images = decode_request_images(request, self.max_image_pixels)
        return self.preprocessor.encode(request.messages, images)

    def run_batch(self, items: Sequence[Prepared], on_done: OnDone, take_more: TakeMoreItems | None = None) -> None:
        """Decode `items` and, between steps, the items `take_more(num_live)` hands over; those are numbered
        after `items`, in the order handed over. A row that cannot be moved to the device fails alone."""
        apply_num_threads(self.num_threads)
        numbers = itertools.count()

        def rows_of(batch: Sequence[Prepared]) -> list[tuple[int, Row]]:
            rows = []
            for item in batch:
                index = next(numbers)
                try:
                    rows.append((index, self.decoder_row(item)))
                except Exception as exc:  # noqa: BLE001 - that request's answer
                    on_done(index, exc)
            return rows

        def done(index: int, result: RowResult | Exception) -> None:
            on_done(index, result if isinstance(result, Exception) else self._completion(result))

        first = rows_of(items)
        more = None if take_more is None else (lambda num_live: rows_of(take_more(num_live)))
        self.decoder.run_indexed(first, done, more)

    def complete(self, request: ChatRequest, images: list["Image"]) -> Completion:
        return run_one(self, self.prepare(request, images))

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
        if self._processes is not None:
            self._processes.close()
            self._processes = None
        self.model = self.decoder = None
        self.grammars = None
        if self.frame_cache is not None:
            self.frame_cache.clear()
        self.num_cuda_empty_cache_calls += release_cuda_cache()

    # ------------------------------------------------------------ helpers

    def decoder_row(self, item: Prepared) -> Row:
        """The decoder's row for one attempt: inputs on the device and a fresh copy of the compiled grammar."""
        inputs = self._on_device(item.inputs)
        grammar = inputs.grammar.deep_copy() if inputs.grammar is not None and self.use_grammar else None
        return Row(inputs, item.request.sampling, grammar, item.cancelled,
                   on_token=text_stream(self.tokenizer, self.eos_token_ids, item.on_text))

    def _on_device(self, inputs: PromptInputs) -> PromptInputs:
        vision = {}
        for key, value in inputs.vision.items():
            if torch.is_tensor(value):
                if torch.is_floating_point(value):
                    value = value.to(self.model.dtype)
                value = value.to(self.device)
            vision[key] = value
        embeds = None if inputs.prefix_embeds is None else inputs.prefix_embeds.to(self.device, self.model.dtype)
        return PromptInputs(inputs.prefix_ids.to(self.device), inputs.suffix_ids.to(self.device), vision,
                            inputs.num_images, inputs.frame, embeds, inputs.grammar)

    def _completion(self, result: RowResult) -> Completion:
        token_ids, is_eos = trim_at_eos(result.token_ids, self.eos_token_ids)
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        extra: dict[str, Any] = {"constrained": result.is_constrained, "kv_cache": result.kv_cache,
                                 "batch_size": result.batch_size, "mean_live_rows": round(result.mean_live_rows, 2),
                                 "timing": {"ttft_ms": round(result.ttft_s * 1000, 3),
                                            "decode_ms": round(result.decode_s * 1000, 3)}}
        if result.is_constrained:
            extra["grammar_ms"] = round(result.grammar_s * 1000, 3)
        if result.vision_s:                   # the image encoding's part of ttft_ms (the rest is the text's prefill)
            extra["vision_ms"] = round(result.vision_s * 1000, 3)
        return Completion(text=text, finish_reason=finish_reason(is_eos), prompt_tokens=result.prompt_tokens,
                          completion_tokens=len(token_ids), extra=extra)

    def _schema_grammars(self) -> "SchemaGrammars":
        """The tokenizer's grammar compiler, made on first use (by a preprocessing thread: hence the lock)."""
        with self._grammars_lock:
            if self.grammars is None:
                from inference_worker.engines.hf.grammar import SchemaGrammars
                vocab_size = self.model.get_output_embeddings().weight.shape[0]
                self.grammars = SchemaGrammars(self.tokenizer, vocab_size=vocab_size,
                                               eos_token_ids=self.eos_token_ids)
            return self.grammars


def can_prefill_together(model: Any) -> bool:
    """Whether cold rows of this model may be prefilled in one left-padded forward: a family whose image tensors
    stack along the batch (pixel_values, pixel_attention_mask) with plain attention layers, or MiniCPM-V 4.6, whose
    images pack NaViT-style (packed_images.py) and whose hybrid cache (linear + full attention) cache_ops merges
    and splits: its linear layers zero padded inputs, so left padding leaves their conv and recurrent states as a
    solo prefill does (tests/test_batched_prefill.py)."""
    from transformers import DynamicCache

    from inference_worker.engines.hf.cache_ops import can_merge_layers, is_plain_attention
    from inference_worker.engines.hf.packed_images import PACKED_IMAGE_FAMILIES

    cache = DynamicCache(config=model.config)
    if model.config.model_type in PACKED_IMAGE_FAMILIES:
        return can_merge_layers(cache)
    return model.config.model_type in STACKABLE_IMAGE_FAMILIES and is_plain_attention(cache)


def _frame_cache(max_bytes: int, similar_threshold: float | None):
    if max_bytes <= 0:
        return None
    from inference_worker.engines.hf.frame_cache import FrameCache
    return FrameCache(max_bytes, similar_threshold)


def grammar_facts(grammar) -> dict[str, Any]:
    """Completion.extra: whether the output was constrained, and the time the grammar took."""
    if grammar is None:
        return {"constrained": False}
    return {"constrained": True, "grammar_ms": round(grammar.elapsed_s * 1000, 3)}


def make_engine(loaded: LoadedModel, options) -> "TransformersEngine":
    """FAMILIES' engine factory for the families transformers supports natively."""
    engine = TransformersEngine.from_loaded(loaded, use_grammar=options.use_grammar, num_threads=options.num_threads,
                                            kv_cache_bytes=options.kv_cache_bytes,
                                            kv_similar_threshold=options.kv_similar_threshold,
                                            max_prompt_tokens=options.max_prompt_tokens)
    if options.prepare_processes:
        engine.start_prepare_processes(options.prepare_processes, options.max_image_pixels)
    return engine


def load_transformers_engine(model: str, *, device: str = "auto", dtype: str = "auto", use_grammar: bool = True,
                             num_threads: int | None = None, progress: bool = True, kv_cache_bytes: int = 0,
                             kv_similar_threshold: float | None = None, prepare_processes: int = 0,
                             max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, max_prompt_tokens: int = 0) -> Engine:
    """Load `model` (folder or Hub id) and wrap it in the engine its family gets (engines/__init__.py FAMILIES).

    Raises ModelLoadError with a user-facing message for anything the user can fix.
    """
    from inference_worker.engines import EngineOptions, load_hf_engine
    return load_hf_engine(model, EngineOptions(device=device, dtype=dtype, use_grammar=use_grammar,
                                               num_threads=num_threads, kv_cache_bytes=kv_cache_bytes,
                                               kv_similar_threshold=kv_similar_threshold,
                                               prepare_processes=prepare_processes,
                                               max_image_pixels=max_image_pixels,
                                               max_prompt_tokens=max_prompt_tokens), progress=progress)
