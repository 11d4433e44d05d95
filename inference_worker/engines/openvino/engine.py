"""The OpenVINO engine: an exported IR folder (optimum-intel) served on the CPU behind the same Engine contract.

`prepare` (a preprocessing thread) decodes the request's images, runs the folder's own Hugging Face processor and
chat template over its messages (the three-turn memory arrives in them, as for every engine), hashes the frame and
compiles the grammar; `answer` (the model thread, one row at a time) runs decode.IRDecoder. JSON output is
constrained token by token with the same llguidance grammar compiler as the transformers engine
(engines/hf/grammar.py), so it is schema-valid by construction; the service still validates it.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from inference_worker.engines.base import EngineStats, OneRowEngine, Prepared
from inference_worker.engines.hf.grammar import GrammarCompiler
from inference_worker.engines.hf.preprocess import image_token_id, template_messages
from inference_worker.engines.hf.sampling import eos_token_ids, finish_reason, trim_at_eos
from inference_worker.engines.hf.special_tokens import escaper_for
from inference_worker.engines.openvino.decode import DecodeResult, IRDecoder, IRPrompt
from inference_worker.engines.openvino.ir_folder import (LANGUAGE_MODEL, TEXT_EMBEDDINGS, VISION_EMBEDDINGS,
                                                         IRFolderError, check_ir_folder)
from inference_worker.engines.openvino.runtime import CompileReport, RuntimeOptions, compile_part, read_properties
from inference_worker.engines.openvino.vision_cache import VisionCache, frame_hash
from inference_worker.engines.options import EngineOptions
from inference_worker.engines.prompt_bounds import PromptBounds, context_tokens_of
from inference_worker.protocol import CacheLevel, ChatRequest, Completion, CompletionFacts, Timing

log = logging.getLogger("inference_worker")

#: the vision-feature budget of an engine built without the worker's options (tests, benchmarks)
DEFAULT_OPTIONS = EngineOptions(kv_cache_bytes=64 * 2**20)


class OpenVINOEngine(OneRowEngine):
    kind = "openvino"
    can_batch = False

    def __init__(self, folder: str | Path, options: EngineOptions = DEFAULT_OPTIONS, *,
                 runtime: RuntimeOptions | None = None, keep_logits: bool = False):
        """`options`: the worker's (grammar, threads, compile cache, vision-feature budget = kv_cache_bytes, prompt
        and image limits); `runtime`: compile settings beyond them (a test's f32 inference), else made from
        `options`; `keep_logits`: each step's logits in the facts (a test's parity check)."""
        self.folder = Path(folder).expanduser()
        config = check_ir_folder(self.folder)
        #: the longest prompt `prepare` lets through: the model's context (config.json), or --max-prompt-tokens
        self.bounds = PromptBounds(context_tokens_of(config), options.max_prompt_tokens)
        self.image_limits = options.image_limits
        self.options = runtime or RuntimeOptions(cache_dir=options.cache_dir, num_threads=options.num_threads or 0)
        self.model_name = self.folder.name
        self.processor, generation_config = _load_processor(self.folder)
        self.tokenizer = self.processor.tokenizer
        self.eos_token_ids = eos_token_ids(generation_config, self.tokenizer)
        self.image_token_id = _image_token(config, self.tokenizer, self.processor)
        self.escape_text = escaper_for(self.tokenizer, self.processor)
        self.report = CompileReport()
        parts = _compile_parts(self.folder, self.options, self.report)
        self.properties = {name: read_properties(part) for name, part in parts.items()}
        self.vocab_size = parts[LANGUAGE_MODEL].output("logits").get_partial_shape()[-1].get_length()
        self.vision_cache = VisionCache(options.kv_cache_bytes) if options.kv_cache_bytes > 0 else None
        self.grammars = GrammarCompiler(self.tokenizer, vocab_size=self.vocab_size, eos_token_ids=self.eos_token_ids,
                                        is_enabled=options.use_grammar)
        self.decoder = IRDecoder(parts[LANGUAGE_MODEL], parts[TEXT_EMBEDDINGS], parts[VISION_EMBEDDINGS],
                                 image_token_id=self.image_token_id, eos_token_ids=self.eos_token_ids,
                                 grammars=self.grammars, vision_cache=self.vision_cache,
                                 keep_logits=keep_logits)
        self.num_requests = 0

    # ------------------------------------------------------------ the contract

    def prepare(self, request: ChatRequest, cancelled: threading.Event | None = None) -> Prepared:
        """Images, template, processor, frame hash and grammar (a preprocessing thread); a prompt longer than
        `bounds` allow is refused (PromptTooLongError), its text before the images, template and tokenizer run."""
        self.bounds.check_text(request)
        item = super().prepare(request, cancelled)
        images = item.images
        prompt = self.processor.apply_chat_template(template_messages(request.messages, self.escape_text),
                                                    add_generation_prompt=True, tokenize=False)
        rgb = [img if img.mode == "RGB" else img.convert("RGB") for img in images]
        batch = self.processor(text=[prompt], images=[rgb] if rgb else None, return_tensors="np")
        self.bounds.check_tokens(int(batch["input_ids"].shape[1]), request)
        pixel_values = batch["pixel_values"].astype("float32") if rgb else None
        inputs = IRPrompt(batch["input_ids"].astype("int64"), pixel_values,
                          frame_hash(pixel_values) if pixel_values is not None else None)
        inputs.matcher = self.grammars.matcher_for(request)      # GrammarError: this row's 400
        item.inputs = inputs
        return item

    def answer(self, item: Prepared) -> Completion:
        matcher = item.inputs.matcher
        prompt = item.inputs if matcher is None else IRPrompt(item.inputs.input_ids, item.inputs.pixel_values,
                                                              item.inputs.frame_key, matcher.deep_copy())
        result = self.decoder.decode(prompt, item.request.sampling, item.cancelled)
        self.num_requests += 1
        return self._completion(result, has_images=item.inputs.pixel_values is not None)

    def stats(self) -> EngineStats:
        cache = self.vision_cache
        kv = {} if cache is None else dict(kv_bytes=cache.num_bytes, kv_entries=cache.num_entries,
                                           kv_evictions=cache.num_evictions)
        steps = self.decoder.num_steps if self.decoder is not None else 0
        return EngineStats(num_decode_steps=steps, num_row_steps=steps, **kv)

    def close(self) -> None:
        self.decoder = None
        if self.vision_cache is not None:
            self.vision_cache.clear()
        self.grammars.close()

    # ------------------------------------------------------------ helpers

    def _completion(self, result: DecodeResult, *, has_images: bool) -> Completion:
        token_ids, is_eos = trim_at_eos(result.token_ids, self.eos_token_ids)
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        facts = CompletionFacts(
            cache=self._cache_level(result, has_images), constrained=result.is_constrained,
            grammar_ms=round(result.grammar_s * 1000, 3) if result.is_constrained else None,
            timing=Timing(ttft_ms=round(result.ttft_s * 1000, 3), decode_ms=round(result.decode_s * 1000, 3)),
            logits=result.logits or None)
        return Completion(text=text, finish_reason=finish_reason(is_eos), prompt_tokens=result.prompt_tokens,
                          completion_tokens=len(token_ids), facts=facts)

    def _cache_level(self, result: DecodeResult, has_images: bool) -> CacheLevel:
        """The vision-feature cache's part in this row: features reused whole (exact) or encoded (miss)."""
        if self.vision_cache is None:
            return CacheLevel.OFF
        if not has_images:
            return CacheLevel.NONE
        return CacheLevel.EXACT if result.vision_cached else CacheLevel.MISS


def _load_processor(folder: Path) -> tuple[Any, Any]:
    from transformers import AutoProcessor, GenerationConfig
    try:
        processor = AutoProcessor.from_pretrained(folder)
    except Exception as exc:  # noqa: BLE001 - one line naming the folder
        raise IRFolderError(f"cannot load the processor of {folder} ({type(exc).__name__}: "
                            f"{' '.join(str(exc).split())[:300]}).") from None
    if not hasattr(processor, "tokenizer"):
        raise IRFolderError(f"{folder} has a tokenizer but no image processor: export it again.")
    try:
        generation_config = GenerationConfig.from_pretrained(folder)
    except OSError:
        generation_config = None
    return processor, generation_config


def _image_token(config: dict[str, Any], tokenizer: Any, processor: Any) -> int:
    from types import SimpleNamespace
    token = image_token_id(SimpleNamespace(**config), tokenizer, processor)
    if token is None:
        raise IRFolderError("the model's config.json names no image token (image_token_index).")
    return token


def _compile_parts(folder: Path, options: RuntimeOptions, report: CompileReport) -> dict[str, Any]:
    import openvino as ov
    core = ov.Core()
    return {name: compile_part(core, folder / f"{name}.xml", options, report, is_stateful=name == LANGUAGE_MODEL)
            for name in (LANGUAGE_MODEL, TEXT_EMBEDDINGS, VISION_EMBEDDINGS)}


def load_openvino_engine(folder: str, options: EngineOptions) -> OpenVINOEngine:
    """The worker's OpenVINO engine: `folder` compiled with the worker's options."""
    engine = OpenVINOEngine(folder, options)
    log.info("OpenVINO engine: %s compiled in %.2f s (%s)", folder, engine.report.compile_s,
             engine.properties.get(LANGUAGE_MODEL, {}))
    return engine
