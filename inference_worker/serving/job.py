"""One request's life inside the service: its future, its cancellation event, its prepared form, its retries, and
the error it ends with when the model does not answer in time."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

from inference_worker.engines.base import Prepared
from inference_worker.errors import ServiceError
from inference_worker.protocol import ChatRequest

TextCallback = Callable[[str], None]


@dataclass
class Job:
    """A request from `submit_job` until it is settled (answered, failed or dropped as cancelled)."""
    request: ChatRequest
    future: Future = field(default_factory=Future)
    arrived_s: float = field(default_factory=time.monotonic)
    prepared: Prepared | None = None
    retries: int = 0
    queue_wait_s: float = 0.0
    #: the one cancellation event of this request; `prepared.cancelled` is this same event
    cancelled: threading.Event = field(default_factory=threading.Event)
    #: called on the model thread with each piece of text as it is generated (streamed requests)
    on_text: TextCallback | None = None
    #: called once the request is prepared and queued (a streamed response then starts; errors before it are
    #: plain HTTP errors)
    on_queued: Callable[[], None] | None = None
    num_text_chars: int = 0               # text handed to on_text so far
    is_waiting: bool = True               # counted against max_queue: accepted, not yet decoding


def timeout_error(timeout_s: float) -> ServiceError:
    return ServiceError(f"The model did not answer within {timeout_s:g} s (--request-timeout-s); it is busy or "
                        "the request is too large.", status=504, code="timeout")
