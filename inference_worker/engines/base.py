"""The one contract every engine meets, and the only thing `serving/` calls.

`prepare(request)` runs on the worker's preprocessing threads: the engine decodes the request's images itself (with
the `ImageLimits` it was built with), then templates, tokenizes, compiles the grammar, keys the frame; it must not
call the model. `run_batch(items, on_done, take_more)`, `after_call` and `close` run on the one model thread. Tests
and benchmarks answer a request the way production does, through `run_one(engine, request)`: `prepare`, then
`run_batch` as a batch of one.

An engine that answers one row at a time (OCR, OpenVINO) derives from `OneRowEngine` and writes only `answer`.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from inference_worker.engines.options import ImageLimits
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
    (a retry changes only sampling); `images` are its decoded images (empty where the engine's preprocessing
    processes decoded them); `inputs` is the engine's own preprocessed form (None for simple engines)."""
    request: ChatRequest
    images: list = field(default_factory=list)
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
    model thread), `device`, `stats()`, and the attributes declared here. Nothing else: the service never probes
    an engine for attributes, and no flag changes at run time who does what."""

    #: the name reported by GET /v1/models and in responses
    model_name: str = "deskeye"
    #: the short engine kind the app reports ("ocr", "transformers", ...)
    kind: str = "engine"
    #: torch.cuda.empty_cache() calls this engine has made (the worker's cuda_empty_cache metric); 0 without CUDA
    num_cuda_empty_cache_calls: int = 0
    #: whether run_batch decodes requests together (else the worker hands it one request at a time)
    can_batch: bool = False
    #: what decoding a request's images may cost; the engine's factory sets the worker's (EngineOptions)
    image_limits: ImageLimits = ImageLimits()

    @abstractmethod
    def prepare(self, request: ChatRequest, cancelled: threading.Event | None = None) -> Prepared:
        """Everything that can happen before the model, on a pool thread: decode the request's images (within
        `image_limits`; stop between two once `cancelled` is set, raising CancelledError), then the engine's own
        preprocessing. A request the engine cannot serve raises ProtocolError (its 4xx). The returned Prepared
        carries `cancelled` (a new event when None)."""

    @abstractmethod
    def run_batch(self, items: Sequence[Prepared], on_done: OnDone, take_more: TakeMoreItems | None = None) -> None:
        """Answer every item, calling `on_done(index, completion or exception)` once for each as it ends; an
        exception for one item is that item's answer, never its neighbours'. An item whose `cancelled` event is
        set ends with RowCancelled. An engine that decodes continuously also answers the items
        `take_more(num_live)` hands over between its steps (numbered after `items`).

        With `request.json_schema` set the text must be constrained to that schema where the engine can (the
        service validates it and retries); a hit token limit is reported as finish_reason="length"."""

    def decode_images(self, request: ChatRequest, cancelled: threading.Event | None = None) -> list["Image"]:
        """The request's images, decoded within this engine's `image_limits` (for `prepare`)."""
        return self.image_limits.decode(request, cancelled)

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


class OneRowEngine(Engine):
    """An engine that answers one request at a time: it writes `answer` (and may extend `prepare`); `run_batch`
    answers the items in turn, each failure that item's alone."""

    def prepare(self, request: ChatRequest, cancelled: threading.Event | None = None) -> Prepared:
        """The request with its decoded images; an engine with more to do before the model extends this."""
        cancelled = cancelled if cancelled is not None else threading.Event()
        return Prepared(request, self.decode_images(request, cancelled), cancelled=cancelled)

    @abstractmethod
    def answer(self, item: Prepared) -> Completion:
        """Answer one prepared request (model thread); streams through `item.on_text` where it is set."""

    def run_batch(self, items: Sequence[Prepared], on_done: OnDone, take_more: TakeMoreItems | None = None) -> None:
        """Each item in turn (it takes no more); an item whose `cancelled` event is set is answered RowCancelled
        without running."""
        for index, item in enumerate(items):
            if item.cancelled.is_set():
                on_done(index, RowCancelled())
                continue
            try:
                completion = self.answer(item)
            except Exception as exc:  # noqa: BLE001 - handed to the service, which answers that request
                on_done(index, exc)
            else:
                on_done(index, completion)


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


def run_one(engine: Engine, request: ChatRequest, *, on_text: Callable[[str], None] | None = None,
            cancelled: threading.Event | None = None) -> Completion:
    """One request the way the service answers it: `engine.prepare`, then `engine.run_batch` as a batch of one;
    raises the error it ended with. `on_text` receives a streamed answer's pieces."""
    item = engine.prepare(request, cancelled)
    item.on_text = on_text
    return run_prepared(engine, item)


def run_prepared(engine: Engine, item: Prepared) -> Completion:
    """One already prepared request through `engine.run_batch` (a test that looks at `item.inputs` first, or an
    engine that wraps another); raises the error it ended with."""
    answers: list = []
    engine.run_batch([item], lambda index, answer: answers.append(answer))
    if isinstance(answers[0], Exception):
        raise answers[0]
    return answers[0]

