"""Choose and load the engine named by the config. Imports lazily: torch loads only for "transformers".

- "ocr": RapidOCR (CPU, models inside its wheel), no torch.
- "transformers": a vision-language model from a local folder or Hugging Face id.
- "openvino": an OpenVINO IR folder (scripts/export_openvino.sh) on the CPU, no torch model (engines/openvino/).
- "auto": openvino when the model is an OpenVINO IR folder (no GPU needed); else transformers when a model is
  given, falling back to OCR (with a warning) when it cannot load;
  OCR when no model is given.
`ground_with_ocr` wraps a model engine so each prompt also carries the OCR text of its images.

Which loader and which engine a model folder gets is decided in one place, `FAMILIES` (first match on the folder's
config.json wins). Entries name their functions as "module:attribute" and are imported only when chosen, so
`loading`, `minicpmo` and `engine` never import one another to decide.
"""

from __future__ import annotations

import importlib
import logging
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from inference_worker.config import DEFAULT_MAX_IMAGE_PIXELS
from inference_worker.errors import one_line

if TYPE_CHECKING:
    from inference_worker.config import WorkerConfig
    from inference_worker.engines.base import Engine

log = logging.getLogger("deskeye.worker")


@dataclass(frozen=True)
class EngineOptions:
    """How a Hugging Face model is loaded and served (from WorkerConfig, or a test)."""
    device: str = "auto"
    dtype: str = "auto"
    use_grammar: bool = True
    num_threads: int | None = None
    kv_cache_bytes: int = 0                       # frame KV (or vision features) budget; counted in the VRAM check
    kv_similar_threshold: float | None = None     # None: the similar level is off
    prepare_processes: int = 0                    # processes running the processor (0: the preprocessing threads)
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS   # the worker's --max-image-pixels, which those processes apply
    max_prompt_tokens: int = 0                    # the worker's --max-prompt-tokens (0 = the model's context)

    def __post_init__(self):
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be at least 1 (or None for torch's default); got {self.num_threads}.")
        if self.kv_cache_bytes < 0:
            raise ValueError(f"kv_cache_bytes must be >= 0 (0 = off); got {self.kv_cache_bytes}.")
        if self.prepare_processes < 0:
            raise ValueError(f"prepare_processes must be >= 0 (0 = threads); got {self.prepare_processes}.")
        if self.max_prompt_tokens < 0:
            raise ValueError(f"max_prompt_tokens must be >= 0 (0 = the context); got {self.max_prompt_tokens}.")


@dataclass(frozen=True)
class Family:
    """A model family: which config.json it claims, the function that loads its parts and the engine factory."""
    name: str
    model_types: tuple[str, ...]       # config.json model_type values it claims; () = any (the fallback)
    load_parts: str                    # "module:function" (path, *, dtype, attn_implementation, device, step)
    make_engine: str                   # "module:function" (LoadedModel, EngineOptions) -> Engine
    claims_remote_code: str = ""       # an auto_map class-name fragment that also claims a folder

    def matches(self, config: dict[str, Any]) -> bool:
        if not self.model_types:
            return True
        auto_map = config.get("auto_map") or {}
        return config.get("model_type") in self.model_types or bool(
            self.claims_remote_code and any(self.claims_remote_code in str(v) for v in auto_map.values()))


FAMILIES: tuple[Family, ...] = (
    Family("minicpmo", ("minicpmo",), "inference_worker.engines.hf.minicpmo:load_minicpmo_parts",
           "inference_worker.engines.hf.minicpmo:make_engine", claims_remote_code="MiniCPMO"),
    Family("minicpmv4_6", ("minicpmv4_6", "minicpmv4_7"), "inference_worker.engines.hf.minicpmv:load_minicpmv_parts",
           "inference_worker.engines.hf.engine:make_engine"),
    Family("transformers", (), "inference_worker.engines.hf.loading:load_transformers_parts",
           "inference_worker.engines.hf.engine:make_engine"),
)


def family_for(config: dict[str, Any]) -> Family:
    """The first family in FAMILIES that claims this config.json."""
    return next(family for family in FAMILIES if family.matches(config))


def _resolve(reference: str) -> Any:
    module, attribute = reference.split(":")
    return getattr(importlib.import_module(module), attribute)


def load_hf_engine(model: str, options: EngineOptions, *, progress: bool = True) -> "Engine":
    """Load `model` (folder or Hub id) with its family's loader and wrap it in its family's engine."""
    from inference_worker.engines.hf.torch_utils import apply_num_threads
    from inference_worker.engines.hf.loading import LoadSpec, load_model

    apply_num_threads(options.num_threads)
    spec = LoadSpec(model, options.device, options.dtype, kv_cache_bytes=options.kv_cache_bytes)
    loaded = load_model(spec, family_for, progress=progress, resolve=_resolve)
    return _resolve(family_for_name(loaded.family).make_engine)(loaded, options)


def family_for_name(name: str) -> Family:
    return next(family for family in FAMILIES if family.name == name)


def _no_progress(message: str) -> None:
    """Default progress callback: ignore."""


def load_engine(config: "WorkerConfig", progress: Callable[[str], None] = _no_progress) -> "Engine":
    engine = _load_base(config, progress)
    if config.ground_with_ocr and engine.kind != "ocr":
        from inference_worker.engines.ocr.grounding import with_ocr_grounding
        progress("loading OCR for grounding")
        engine = with_ocr_grounding(engine)
    return engine


def _load_base(config: "WorkerConfig", progress: Callable[[str], None]) -> "Engine":
    if config.engine == "openvino" or (config.engine == "auto" and _is_ir_folder(config.model)):
        return _load_openvino(config, progress)
    if not config.wants_transformers:
        return _load_ocr(progress)
    if config.engine == "transformers":
        return _load_transformers(config, progress)
    try:
        return _load_transformers(config, progress)
    except Exception as exc:  # noqa: BLE001 - "auto" falls back to OCR, loudly
        reason = one_line(exc)
        log.warning("cannot load model %r (%s); --engine auto falls back to the OCR engine", config.model, reason)
        return _load_ocr(progress)


def _is_ir_folder(model: str) -> bool:
    from inference_worker.engines.openvino.ir_folder import is_ir_folder
    return bool(model) and is_ir_folder(model)


def _load_openvino(config: "WorkerConfig", progress: Callable[[str], None]) -> "Engine":
    from inference_worker.engines.openvino.engine import load_openvino_engine
    progress(f"compiling {config.model} with OpenVINO")
    return load_openvino_engine(config.model, use_grammar=config.use_grammar, num_threads=config.num_threads,
                                cache_dir=config.cache_dir, vision_cache_bytes=config.kv_cache_bytes,
                                max_prompt_tokens=config.max_prompt_tokens)


def _load_ocr(progress: Callable[[str], None]) -> "Engine":
    from inference_worker.engines.ocr.engine import OcrEngine
    progress("loading OCR engine")
    return OcrEngine()


def _load_transformers(config: "WorkerConfig", progress: Callable[[str], None]) -> "Engine":
    progress(f"loading {config.model}")
    options = EngineOptions(device=config.device, dtype=config.dtype, use_grammar=config.use_grammar,
                            num_threads=config.num_threads or None, kv_cache_bytes=config.kv_cache_bytes,
                            kv_similar_threshold=config.kv_similar_threshold if config.kv_similar else None,
                            prepare_processes=config.prepare_processes, max_image_pixels=config.max_image_pixels,
                            max_prompt_tokens=config.max_prompt_tokens)
    return load_hf_engine(config.model, options, progress=sys.stderr.isatty())   # a tqdm bar for people only
