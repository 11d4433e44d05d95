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
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from inference_worker.errors import CancelledError, ProtocolError, ServiceError
from inference_worker.protocol import ChatRequest, Completion, chunk_body, usage_body
from inference_worker.serving.service import timeout_error

SSE_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}


async def stream_answer(routes, request: ChatRequest, http: Request) -> StreamingResponse:
    """Accept the request, wait until it is prepared (errors so far are plain HTTP errors), then stream."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    queued, answered = asyncio.Event(), asyncio.Event()
    put = lambda item: loop.call_soon_threadsafe(events.put_nowait, item)  # noqa: E731 - from the model thread
    job = routes.service.submit_job(request, on_text=lambda text: put(("text", text)),
                                    on_queued=lambda: loop.call_soon_threadsafe(queued.set))

    def settled(future: Future) -> None:
        """On the thread that settles the job. An event, not asyncio.wrap_future: a wrapped future nobody awaits
        once the stream has started would keep the job's error (a closed stream's cancellation, a schema
        failure) and log "Future exception was never retrieved" when it is collected."""
        put(("done", future))
        loop.call_soon_threadsafe(answered.set)

    job.future.add_done_callback(settled)
    deadline_s = time.monotonic() + routes.config.request_timeout_s
    waits = {asyncio.ensure_future(queued.wait()), asyncio.ensure_future(answered.wait())}
    try:
        await asyncio.wait(waits, timeout=routes.config.request_timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waits:
            waiter.cancel()
    if not queued.is_set():
        if not answered.is_set():
            routes.service.cancel(job, "not prepared in time")
            raise timeout_error(routes.config.request_timeout_s)
        _raise_outcome(job.future)          # an error before the stream started: a plain HTTP error
    model = routes.ready_engine().model_name
    stream = _events(routes, job, events, deadline_s, _Ids(model), request.include_usage)
    return StreamingResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS)


class _Ids:
    def __init__(self, model: str):
        self.request_id = f"chatcmpl-{uuid.uuid4().hex}"
        self.model = model
        self.created = int(time.time())

    def chunk(self, delta: dict[str, Any] | None, **fields: Any) -> str:
        return sse(chunk_body(request_id=self.request_id, model=self.model, created=self.created, delta=delta,
                              **fields))


async def _events(routes, job, events: asyncio.Queue, deadline_s: float, ids: _Ids,
                  include_usage: bool) -> AsyncIterator[str]:
    metrics = routes.metrics
    sent = ""
    outcome = "cancelled"
    try:
        yield ids.chunk({"role": "assistant", "content": ""})
        while True:
            try:
                kind, value = await asyncio.wait_for(events.get(), max(0.0, deadline_s - time.monotonic()))
            except asyncio.TimeoutError:
                routes.service.cancel(job, "no answer in time")
                outcome = "error"
                yield sse(timeout_error(routes.config.request_timeout_s).to_body())
                return
            if kind == "text":
                sent += value
                yield ids.chunk({"content": value})
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
            yield ids.chunk({"content": rest})
        yield ids.chunk({}, finish_reason=completion.finish_reason, extra={"retries": completion.retries,
                                                                           **completion.extra})
        if include_usage:
            yield ids.chunk(None, usage=usage_body(completion))
        yield "data: [DONE]\n\n"
        outcome = "ok"
    finally:                                 # also when the client closed the stream (the task is cancelled)
        routes.service.cancel(job, "the client closed the stream")
        metrics.streams.labels(outcome=outcome).inc()


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
