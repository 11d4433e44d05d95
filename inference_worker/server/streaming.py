"""`stream=true`: the answer as Server-Sent Events in OpenAI's chat.completion.chunk format.

The request is accepted and prepared first, so a bad image or a full queue is still a plain HTTP error. Then
the stream sends a first chunk with the assistant role, one chunk per piece of text the engine hands over as it
generates (Prepared.on_text), a last chunk with finish_reason (and DeskEye's facts), a usage-only chunk when
`stream_options.include_usage` is set, and `data: [DONE]`. JSON output is still constrained by the grammar
while it streams and validated at the end; a failed validation (or engine error, or timeout) ends the stream
with `data: {"error": {...}}`, the event OpenAI's clients raise as an error. A streamed answer is never
retried once text was sent. A client that closes the stream cancels the request.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi.responses import StreamingResponse

from inference_worker.errors import CancelledError, ProtocolError, ServiceError
from inference_worker.metrics import WorkerMetrics
from inference_worker.protocol import ChatRequest, ChunkDelta, Completion, DeskEyeFacts, chunk_body, usage_of
from inference_worker.serving.service import Job, ModelService, timeout_error

SSE_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}


async def stream_answer(service: ModelService, metrics: WorkerMetrics, request: ChatRequest, *, model: str,
                        timeout_s: float) -> StreamingResponse:
    """Accept the request, wait until it is prepared (errors so far are plain HTTP errors), then stream. `model`
    names the served model in every chunk; `timeout_s` (--request-timeout-s) bounds the whole answer."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    queued, answered = asyncio.Event(), asyncio.Event()
    put = lambda item: loop.call_soon_threadsafe(events.put_nowait, item)  # noqa: E731 - from the model thread
    job = service.submit_job(request, on_text=lambda text: put(("text", text)),
                             on_queued=lambda: loop.call_soon_threadsafe(queued.set))

    def settled(future: Future) -> None:
        """On the thread that settles the job. An event, not asyncio.wrap_future: a wrapped future nobody awaits
        once the stream has started would keep the job's error (a closed stream's cancellation, a schema
        failure) and log "Future exception was never retrieved" when it is collected."""
        put(("done", future))
        loop.call_soon_threadsafe(answered.set)

    job.future.add_done_callback(settled)
    deadline_s = time.monotonic() + timeout_s
    waits = {asyncio.ensure_future(queued.wait()), asyncio.ensure_future(answered.wait())}
    try:
        await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waits:
            waiter.cancel()
    if not queued.is_set():
        if not answered.is_set():
            service.cancel(job, "not prepared in time")
            raise timeout_error(timeout_s)
        _raise_outcome(job.future)          # an error before the stream started: a plain HTTP error
    stream = _Stream(service, metrics, job, events, _Ids(model), deadline_s, timeout_s, request.include_usage)
    return StreamingResponse(_events(stream), media_type="text/event-stream", headers=SSE_HEADERS)


class _Ids:
    def __init__(self, model: str):
        self.request_id = f"chatcmpl-{uuid.uuid4().hex}"
        self.model = model
        self.created = int(time.time())

    def chunk(self, delta: ChunkDelta | None, **fields: Any) -> str:
        return sse(chunk_body(request_id=self.request_id, model=self.model, created=self.created, delta=delta,
                              **fields))


@dataclass(frozen=True)
class _Stream:
    """One streamed answer: its job, the events the model thread hands over, and its deadline."""
    service: ModelService
    metrics: WorkerMetrics
    job: Job
    events: asyncio.Queue
    ids: _Ids
    deadline_s: float
    timeout_s: float
    include_usage: bool


async def _events(stream: _Stream) -> AsyncIterator[str]:
    ids, job = stream.ids, stream.job
    sent = ""
    outcome = "cancelled"
    try:
        yield ids.chunk(ChunkDelta(role="assistant", content=""))
        while True:
            try:
                kind, value = await asyncio.wait_for(stream.events.get(),
                                                     max(0.0, stream.deadline_s - time.monotonic()))
            except asyncio.TimeoutError:
                stream.service.cancel(job, "no answer in time")
                outcome = "error"
                yield sse(timeout_error(stream.timeout_s).to_body())
                return
            if kind == "text":
                sent += value
                yield ids.chunk(ChunkDelta(content=value))
                continue
            try:
                completion = _raise_outcome(value)
            except ProtocolError as exc:
                outcome = "error"
                yield sse(exc.to_body())
                return
            break
        rest = completion.text[len(sent):] if completion.text.startswith(sent) else ""
        if rest:                             # an engine that does not stream hands over its text at the end
            yield ids.chunk(ChunkDelta(content=rest))
        yield ids.chunk(ChunkDelta(), finish_reason=completion.finish_reason, deskeye=DeskEyeFacts.of(completion))
        if stream.include_usage:
            yield ids.chunk(None, usage=usage_of(completion))
        yield "data: [DONE]\n\n"
        outcome = "ok"
    finally:                                 # also when the client closed the stream (the task is cancelled)
        stream.service.cancel(job, "the client closed the stream")
        stream.metrics.streams.labels(outcome=outcome).inc()


def _raise_outcome(future: Future) -> Completion:
    if future.cancelled():
        raise CancelledError("the client went away or timed out")
    exc = future.exception()
    if exc is None:
        return future.result()
    if isinstance(exc, ProtocolError):
        raise exc
    raise ServiceError(f"Internal error: {type(exc).__name__}", status=500, code="server_error")


def sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
