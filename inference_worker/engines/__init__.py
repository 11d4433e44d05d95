"""Choose and load the engine named by the config. Imports lazily: torch loads only for "transformers".

- "ocr": RapidOCR (CPU, models inside its wheel), no torch.
- "transformers": a vision-language model from a local folder or Hugging Face id.
- "openvino": an OpenVINO IR folder (scripts/export_openvino.sh) on the CPU, no torch model (engines/openvino/).
- "auto": openvino when the model is an OpenVINO IR folder (no GPU needed); else transformers when a model is
  given, falling back to OCR (with a warning) when it cannot load;
  OCR when no model is given.
`ground_with_ocr` wraps a model engine so each prompt also carries the OCR text of its images. The names are
config.ENGINES; `LOADERS` maps each to its loader. Every engine is built from one `EngineOptions`, made from the
worker's config in one place (`EngineOptions.from_config`, options.py).

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

from inference_worker.engines.options import EngineOptions, ImageLimits
from inference_worker.errors import one_line

if TYPE_CHECKING:
    from inference_worker.config import WorkerConfig
    from inference_worker.engines.base import Engine

__all__ = ["FAMILIES", "EngineOptions", "Family", "ImageLimits", "family_for", "load_engine", "load_hf_engine"]

log = logging.getLogger("inference_worker")


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
    Family("minicpmo", ("minicpmo",), "inference_worker.engines.hf.minicpmo_loading:load_minicpmo_parts",
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
    spec = LoadSpec(model, options.device, options.dtype, kv_cache_bytes=options.kv_cache_bytes,
                    decode_weights=options.decode_weights)
    loaded = load_model(spec, family_for, progress=progress, resolve=_resolve)
    return _resolve(family_for_name(loaded.family).make_engine)(loaded, options)


def family_for_name(name: str) -> Family:
    return next(family for family in FAMILIES if family.name == name)


def _no_progress(message: str) -> None:
    """Default progress callback: ignore."""


def load_engine(config: "WorkerConfig", progress: Callable[[str], None] = _no_progress) -> "Engine":
    """The engine `config.engine` names (one of config.ENGINES), built with the options made from `config`."""
    options = EngineOptions.from_config(config)
    engine = LOADERS[config.engine](config.model, options, progress)
    if config.ground_with_ocr and engine.kind != "ocr":
        from inference_worker.engines.ocr.grounding import with_ocr_grounding
        progress("loading OCR for grounding")
        engine = with_ocr_grounding(engine, options)
    return engine


Loader = Callable[[str, EngineOptions, Callable[[str], None]], "Engine"]   # (model, options, progress) -> Engine


def _load_auto(model: str, options: EngineOptions, progress: Callable[[str], None]) -> "Engine":
    """OpenVINO for an IR folder, else transformers for a model (OCR, loudly, when it cannot load), else OCR."""
    if _is_ir_folder(model):
        return _load_openvino(model, options, progress)
    if not model:
        return _load_ocr(model, options, progress)
    try:
        return _load_transformers(model, options, progress)
    except Exception as exc:  # noqa: BLE001 - "auto" falls back to OCR, loudly
        log.warning("cannot load model %r (%s); --engine auto falls back to the OCR engine", model, one_line(exc))
        return _load_ocr(model, options, progress)


def _is_ir_folder(model: str) -> bool:
    from inference_worker.engines.openvino.ir_folder import is_ir_folder
    return bool(model) and is_ir_folder(model)


def _load_openvino(model: str, options: EngineOptions, progress: Callable[[str], None]) -> "Engine":
    from inference_worker.engines.openvino.engine import load_openvino_engine
    progress(f"compiling {model} with OpenVINO")
    return load_openvino_engine(model, options)


def _load_ocr(model: str, options: EngineOptions, progress: Callable[[str], None]) -> "Engine":
    from inference_worker.engines.ocr.engine import OcrEngine
    progress("loading OCR engine")
    return OcrEngine(options=options)


def _load_transformers(model: str, options: EngineOptions, progress: Callable[[str], None]) -> "Engine":
    progress(f"loading {model}")
    return load_hf_engine(model, options, progress=sys.stderr.isatty())   # a tqdm bar for people only


#: config.ENGINES name -> its loader (tests/test_engine_layout.py checks that every name has one)
LOADERS: dict[str, Loader] = {"auto": _load_auto, "ocr": _load_ocr, "transformers": _load_transformers,
                              "openvino": _load_openvino}
