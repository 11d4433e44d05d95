"""Choose and load the engine named by the config. Imports lazily: torch loads only for "transformers".

- "ocr": RapidOCR (CPU, models inside its wheel), no torch.
- "transformers": a vision-language model from a local folder or Hugging Face id.
- "auto": transformers when a model is given, falling back to OCR (with a warning) when it cannot load;
  OCR when no model is given.
`ground_with_ocr` wraps a model engine so each prompt also carries the OCR text of its images.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from inference_worker.config import WorkerConfig
    from inference_worker.engines.base import Engine

log = logging.getLogger("deskeye.worker")


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
    if not config.wants_transformers:
        return _load_ocr(progress)
    if config.engine == "transformers":
        return _load_transformers(config, progress)
    try:
        return _load_transformers(config, progress)
    except Exception as exc:  # noqa: BLE001 - "auto" falls back to OCR, loudly
        reason = " ".join(str(exc).split()) or type(exc).__name__
        log.warning("cannot load model %r (%s); --engine auto falls back to the OCR engine", config.model, reason)
        return _load_ocr(progress)


def _load_ocr(progress: Callable[[str], None]) -> "Engine":
    from inference_worker.engines.ocr.engine import OcrEngine
    progress("loading OCR engine")
    return OcrEngine()


def _load_transformers(config: "WorkerConfig", progress: Callable[[str], None]) -> "Engine":
    from inference_worker.engines.hf.engine import load_transformers_engine
    progress(f"loading {config.model}")
    return load_transformers_engine(config.model, device=config.device, dtype=config.dtype,
                                    use_grammar=config.use_grammar, num_threads=config.num_threads or None,
                                    kv_cache_bytes=config.kv_cache_bytes,
                                    kv_similar_threshold=config.kv_similar_threshold if config.kv_similar else None,
                                    progress=sys.stderr.isatty())   # a tqdm bar for people, not for log files
