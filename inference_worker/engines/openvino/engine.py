"""The OpenVINO engine: an exported IR folder (optimum-intel) served on the CPU behind the same Engine contract.

`prepare` (a preprocessing thread) runs the folder's own Hugging Face processor and chat template over the request's
messages (the three-turn memory arrives in them, as for every engine), hashes the frame and compiles the grammar;
`complete_prepared` (the model thread) runs decode.IRDecoder. JSON output is constrained token by token with the
same llguidance grammar as the transformers engine (engines/hf/grammar.py), so it is schema-valid by construction;
the service still validates it.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inference_worker.engines.base import Engine, EngineStats, Prepared, run_one
from inference_worker.engines.hf.preprocess import image_token_id, template_messages
from inference_worker.engines.hf.sampling import eos_token_ids, finish_reason, trim_at_eos
from inference_worker.engines.hf.special_tokens import escaper_for
from inference_worker.engines.openvino.decode import DecodeResult, IRDecoder, IRPrompt
from inference_worker.engines.openvino.ir_folder import (LANGUAGE_MODEL, TEXT_EMBEDDINGS, VISION_EMBEDDINGS,
                                                         IRFolderError, check_ir_folder)
from inference_worker.engines.openvino.runtime import CompileReport, RuntimeOptions, compile_part, read_properties
from inference_worker.engines.openvino.vision_cache import VisionCache, frame_hash
from inference_worker.engines.prompt_bounds import PromptBounds, context_tokens_of
from inference_worker.protocol import ChatRequest, Completion

if TYPE_CHECKING:
    from PIL.Image import Image

log = logging.getLogger("deskeye.worker")

DEFAULT_VISION_CACHE_BYTES = 64 * 2**20


class OpenVINOEngine(Engine):
    kind = "openvino"
    can_batch = False

    def __init__(self, folder: str | Path, options: RuntimeOptions = RuntimeOptions(), *, use_grammar: bool = True,
                 vision_cache_bytes: int = DEFAULT_VISION_CACHE_BYTES, keep_logits: bool = False,
                 max_prompt_tokens: int = 0):
        self.folder = Path(folder).expanduser()
        config = check_ir_folder(self.folder)
        #: the longest prompt `prepare` lets through: the model's context (config.json), or --max-prompt-tokens
        self.bounds = PromptBounds(context_tokens_of(config), max_prompt_tokens)
        self.options = options
        self.model_name = self.folder.name
        self.use_grammar = use_grammar
        self.processor, generation_config = _load_processor(self.folder)
        self.tokenizer = self.processor.tokenizer
        self.eos_token_ids = eos_token_ids(generation_config, self.tokenizer)
        self.image_token_id = _image_token(config, self.tokenizer, self.processor)
        self.escape_text = escaper_for(self.tokenizer, self.processor)
        self.report = CompileReport()
        parts = _compile_parts(self.folder, options, self.report)
        self.properties = {name: read_properties(part) for name, part in parts.items()}
        self.vocab_size = parts[LANGUAGE_MODEL].output("logits").get_partial_shape()[-1].get_length()
        self.vision_cache = VisionCache(vision_cache_bytes) if vision_cache_bytes > 0 else None
        self.grammars = None
        self._grammars_lock = threading.Lock()
        self.decoder = IRDecoder(parts[LANGUAGE_MODEL], parts[TEXT_EMBEDDINGS], parts[VISION_EMBEDDINGS],
                                 image_token_id=self.image_token_id, eos_token_ids=self.eos_token_ids,
                                 grammars=self._schema_grammars, vision_cache=self.vision_cache,
                                 keep_logits=keep_logits)
        self.num_requests = 0

    # ------------------------------------------------------------ the contract

    def prepare(self, request: ChatRequest, images: list["Image"]) -> Prepared:
        """Template, processor, frame hash and grammar (a preprocessing thread); a prompt longer than `bounds`
        allow is refused (PromptTooLongError), its text before the template and tokenizer run."""
        self.bounds.check_text(request)
        prompt = self.processor.apply_chat_template(template_messages(request.messages, self.escape_text),
                                                    add_generation_prompt=True, tokenize=False)
        rgb = [img if img.mode == "RGB" else img.convert("RGB") for img in images]
        batch = self.processor(text=[prompt], images=[rgb] if rgb else None, return_tensors="np")
        self.bounds.check_tokens(int(batch["input_ids"].shape[1]), request)
        pixel_values = batch["pixel_values"].astype("float32") if rgb else None
        inputs = IRPrompt(batch["input_ids"].astype("int64"), pixel_values,
                          frame_hash(pixel_values) if pixel_values is not None else None)
        if request.json_schema is not None and self.use_grammar:
            inputs.matcher = self._schema_grammars().matcher(request.json_schema)   # GrammarError: this row's 400
        return Prepared(request, images, inputs)

    def complete_prepared(self, item: Prepared) -> Completion:
        matcher = item.inputs.matcher
        prompt = item.inputs if matcher is None else IRPrompt(item.inputs.input_ids, item.inputs.pixel_values,
                                                              item.inputs.frame_key, matcher.deep_copy())
        result = self.decoder.decode(prompt, item.request.sampling, item.cancelled)
        self.num_requests += 1
        return self._completion(result)

    def complete(self, request: ChatRequest, images: list["Image"]) -> Completion:
        return run_one(self, self.prepare(request, images))

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
        if self.grammars is not None:
            self.grammars.close()

    # ------------------------------------------------------------ helpers

    def _completion(self, result: DecodeResult) -> Completion:
        token_ids, is_eos = trim_at_eos(result.token_ids, self.eos_token_ids)
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        extra: dict[str, Any] = {"constrained": result.is_constrained, "vision_cache": result.vision_cached,
                                 "timing": {"ttft_ms": round(result.ttft_s * 1000, 3),
                                            "decode_ms": round(result.decode_s * 1000, 3)}}
        if result.is_constrained:
            extra["grammar_ms"] = round(result.grammar_s * 1000, 3)
        if result.logits:
            extra["logits"] = result.logits
        return Completion(text=text, finish_reason=finish_reason(is_eos), prompt_tokens=result.prompt_tokens,
                          completion_tokens=len(token_ids), extra=extra)

    def _schema_grammars(self):
        """The tokenizer's grammar compiler, made on first use (by a preprocessing thread: hence the lock)."""
        with self._grammars_lock:
            if self.grammars is None:
                from inference_worker.engines.hf.grammar import SchemaGrammars
                self.grammars = SchemaGrammars(self.tokenizer, vocab_size=self.vocab_size,
                                               eos_token_ids=self.eos_token_ids)
            return self.grammars


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


def load_openvino_engine(folder: str, *, use_grammar: bool = True, num_threads: int = 0,
                         cache_dir: str | Path | None = None, vision_cache_bytes: int = DEFAULT_VISION_CACHE_BYTES,
                         max_prompt_tokens: int = 0) -> OpenVINOEngine:
    options = RuntimeOptions(cache_dir=Path(cache_dir) if cache_dir else None, num_threads=num_threads)
    engine = OpenVINOEngine(folder, options, use_grammar=use_grammar, vision_cache_bytes=vision_cache_bytes,
                            max_prompt_tokens=max_prompt_tokens)
    log.info("OpenVINO engine: %s compiled in %.2f s (%s)", folder, engine.report.compile_s,
             engine.properties.get(LANGUAGE_MODEL, {}))
    return engine
