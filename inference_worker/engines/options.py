"""How every engine is built and what it may accept: one object, made from `WorkerConfig` in one place
(`EngineOptions.from_config`) and handed to every engine factory (OCR, OpenVINO, the Hugging Face families, OCR
grounding). Tests build it directly with only the fields they care about."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from inference_worker.config import DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_REQUEST_PIXELS
from inference_worker.images import decode_request_images

if TYPE_CHECKING:
    import threading

    from PIL.Image import Image

    from inference_worker.config import WorkerConfig
    from inference_worker.protocol import ChatRequest


@dataclass(frozen=True)
class ImageLimits:
    """What decoding a request's images may cost (the worker's --max-image-pixels and --max-request-pixels). The
    engine decodes its images in `prepare` with these, so it and the service's header check agree."""
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_request_pixels: int = DEFAULT_MAX_REQUEST_PIXELS

    def __post_init__(self):
        if self.max_image_pixels < 1 or self.max_request_pixels < self.max_image_pixels:
            raise ValueError("image limits need 1 <= max_image_pixels <= max_request_pixels; got "
                             f"{self.max_image_pixels} and {self.max_request_pixels}.")

    def decode(self, request: "ChatRequest", cancelled: "threading.Event | None" = None) -> list["Image"]:
        """The request's images as RGB, in order, once every header passed these limits (images.py); stops
        between two images once `cancelled` is set (CancelledError)."""
        return decode_request_images(request, self.max_image_pixels, max_request_pixels=self.max_request_pixels,
                                     cancelled=cancelled)


@dataclass(frozen=True)
class EngineOptions:
    """How an engine is loaded and served (from WorkerConfig via `from_config`, or a test)."""
    device: str = "auto"
    dtype: str = "auto"
    use_grammar: bool = True
    num_threads: int | None = None                # None: the library's default
    kv_cache_bytes: int = 0                       # frame KV (or vision features) budget; counted in the VRAM check
    kv_similar_threshold: float | None = None     # None: the similar level is off
    prepare_processes: int = 0                    # processes running the processor (0: the preprocessing threads)
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS       # one image (--max-image-pixels)
    max_request_pixels: int = DEFAULT_MAX_REQUEST_PIXELS   # all of a request's images (--max-request-pixels)
    max_prompt_tokens: int = 0                    # the worker's --max-prompt-tokens (0 = the model's context)
    cache_dir: Path | None = None                 # OpenVINO's compiled-model cache (None: the user cache dir)
    decode_weights: str = "model"                 # auto | int8 | model (--decode-weights; hf/int8_decode.py)

    def __post_init__(self):
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be at least 1 (or None for torch's default); got {self.num_threads}.")
        if self.kv_cache_bytes < 0:
            raise ValueError(f"kv_cache_bytes must be >= 0 (0 = off); got {self.kv_cache_bytes}.")
        if self.prepare_processes < 0:
            raise ValueError(f"prepare_processes must be >= 0 (0 = threads); got {self.prepare_processes}.")
        if self.max_prompt_tokens < 0:
            raise ValueError(f"max_prompt_tokens must be >= 0 (0 = the context); got {self.max_prompt_tokens}.")
        ImageLimits(self.max_image_pixels, self.max_request_pixels)      # raises for limits that cannot hold

    @property
    def image_limits(self) -> ImageLimits:
        return ImageLimits(self.max_image_pixels, self.max_request_pixels)

    @classmethod
    def from_config(cls, config: "WorkerConfig") -> "EngineOptions":
        """The one place the worker's flags become engine options."""
        return cls(device=config.device, dtype=config.dtype, use_grammar=config.use_grammar,
                   num_threads=config.num_threads or None, kv_cache_bytes=config.kv_cache_bytes,
                   kv_similar_threshold=config.kv_similar_threshold if config.kv_similar else None,
                   prepare_processes=config.prepare_processes, max_image_pixels=config.max_image_pixels,
                   max_request_pixels=config.max_request_pixels, max_prompt_tokens=config.max_prompt_tokens,
                   cache_dir=config.cache_dir, decode_weights=config.decode_weights)
