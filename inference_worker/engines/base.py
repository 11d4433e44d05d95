"""The contract every engine meets. One thread (the worker's model thread) calls `complete` and `run_batch`;
`prepare` runs on the worker's preprocessing threads, so it must not call the model."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from inference_worker.errors import CancelledError
from inference_worker.protocol import ChatRequest, Completion

if TYPE_CHECKING:
    from PIL.Image import Image

#: run_batch's callback: (index in the batch, the completion or the exception that request ended with)
OnDone = Callable[[int, "Completion | Exception"], None]
#: run_batch's source of rows joining a running decode: (rows decoding now) -> prepared requests that arrived
#: since (possibly none); it never waits. They are numbered after the batch's items, in the order handed over.
TakeMoreItems = Callable[[int], Sequence["Prepared"]]


class RowCancelled(CancelledError):
    """A row's outcome when its `Prepared.cancelled` event was set: it stopped decoding and is never retried."""

    def __init__(self, reason: str = "its client went away or it timed out"):
        super().__init__(reason)


@dataclass
class Prepared:
    """A request made ready for the model off the model thread. `request` may be replaced between attempts
    (a retry changes only sampling); `inputs` is the engine's own preprocessed form (None for simple engines)."""
    request: ChatRequest
    images: list
    inputs: Any = None
    #: set by the service when the client went away or timed out: the engine ends the row at its next step
    cancelled: threading.Event = field(default_factory=threading.Event)
    #: set by the service for a streamed request: the engine calls it (model thread) with each new piece of the
    #: answer's text as it is generated; the pieces concatenate to Completion.text
    on_text: Callable[[str], None] | None = None


@dataclass(frozen=True)
class EngineStats:
    """What an engine reports to the worker's /metrics after each model call."""
    live_rows: int = 0                      # rows decoding right now
    num_cuda_empty_cache_calls: int = 0     # torch.cuda.empty_cache() calls so far (0 without CUDA)
    kv_bytes: int = 0                       # bytes of frame KV held
    kv_entries: int = 0
    kv_evictions: int = 0
    num_decode_steps: int = 0               # batched decode steps so far
    num_row_steps: int = 0                  # rows decoded, summed over those steps (/ steps = mean live rows)


class Engine(ABC):
    """What the service calls: `prepare` (preprocessing threads), `run_batch`, `after_call` and `close` (the
    model thread), `device`, `stats()`, and the flags declared here (`can_batch`, `decodes_images`). Nothing else:
    the service never probes an engine for attributes."""

    #: the name reported by GET /v1/models and in responses
    model_name: str = "deskeye"
    #: the short engine kind the app reports ("ocr", "transformers", ...)
    kind: str = "engine"
    #: torch.cuda.empty_cache() calls this engine has made (the worker's cuda_empty_cache metric); 0 without CUDA
    num_cuda_empty_cache_calls: int = 0
    #: whether run_batch decodes requests together (else the worker hands it one request at a time)
    can_batch: bool = False
    #: whether `prepare` decodes the request's images itself (the service then passes images=None): an engine
    #: whose preprocessing runs in other processes, which take the encoded files rather than decoded pixels
    decodes_images: bool = False

    @abstractmethod
    def complete(self, request: ChatRequest, images: list["Image"]) -> Completion:
        """Answer one request. `images` are the request's images, decoded and size-checked, in order.

        With `request.json_schema` set the text must be constrained to that schema where the engine can
        (the service validates it and retries); a hit token limit is reported as finish_reason="length".
        """

    def prepare(self, request: ChatRequest, images: list["Image"] | None) -> Prepared:
        """Everything that can happen before the model (processor, tokenizing); runs on a pool thread. `images`
        is None only for an engine that `decodes_images`."""
        return Prepared(request, images)

    def complete_prepared(self, item: Prepared) -> Completion:
        """Answer one prepared request; the default `run_batch` calls this for each item in turn."""
        return self.complete(item.request, item.images)

    def run_batch(self, items: Sequence[Prepared], on_done: OnDone, take_more: TakeMoreItems | None = None) -> None:
        """Answer every item, calling `on_done` as each ends. An engine that decodes continuously also answers the
        items `take_more(num_live)` hands over between its steps (numbered after `items`). This default answers
        `items` one by one (it takes no more); an exception for one item is that item's answer, and an item whose
        `cancelled` event is set is answered RowCancelled without running."""
        for index, item in enumerate(items):
            if item.cancelled.is_set():
                on_done(index, RowCancelled())
                continue
            try:
                completion = self.complete_prepared(item)
            except Exception as exc:  # noqa: BLE001 - handed to the service, which answers that request
                on_done(index, exc)
            else:
                on_done(index, completion)

    @property
    def device(self) -> Any:
        """Where the model runs (a torch.device for model engines); "cpu" for engines without torch."""
        return "cpu"

    def stats(self) -> EngineStats:
        """The engine's counters, read by the service after each model call."""
        return EngineStats(num_cuda_empty_cache_calls=self.num_cuda_empty_cache_calls)

    def after_call(self) -> None:
        """Drop per-request state; on CUDA, empty the cache. Runs on the model thread after every call."""

    def close(self) -> None:
        """Free the model."""


def emit_in_pieces(text: str, on_text: Callable[[str], None] | None, *, max_piece_chars: int = 16) -> None:
    """For an engine that makes its whole answer at once (OCR): stream it as word-sized pieces."""
    if on_text is None:
        return
    start = 0
    while start < len(text):
        end = min(len(text), start + max_piece_chars)
        space = text.rfind(" ", start + 1, end)
        end = space + 1 if end < len(text) and space > start else end
        on_text(text[start:end])
        start = end


def run_one(engine: Engine, item: Prepared) -> Completion:
    """One prepared request through `engine.run_batch`, as a batch of one; raises the error it ended with."""
    answers: list = []
    engine.run_batch([item], lambda index, answer: answers.append(answer))
    if isinstance(answers[0], Exception):
        raise answers[0]
    return answers[0]
