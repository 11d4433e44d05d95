"""The contract every engine meets. One thread (the worker's model thread) calls `complete`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from inference_worker.protocol import ChatRequest, Completion

if TYPE_CHECKING:
    from PIL.Image import Image


class Engine(ABC):
    #: the name reported by GET /v1/models and in responses
    model_name: str = "deskeye"
    #: the short engine kind the app reports ("ocr", "transformers", ...)
    kind: str = "engine"
    #: torch.cuda.empty_cache() calls this engine has made (the worker's cuda_empty_cache metric); 0 without CUDA
    num_cuda_empty_cache_calls: int = 0

    @abstractmethod
    def complete(self, request: ChatRequest, images: list["Image"]) -> Completion:
        """Answer one request. `images` are the request's images, decoded and size-checked, in order.

        With `request.json_schema` set the text must be constrained to that schema where the engine can
        (the service validates it and retries); a hit token limit is reported as finish_reason="length".
        """

    def after_call(self) -> None:
        """Drop per-request state; on CUDA, empty the cache. Runs on the model thread after every call."""

    def close(self) -> None:
        """Free the model."""
