"""The model thread and what feeds it.

HTTP threads `submit` requests. A small pool prepares each one off the model thread (its images' headers checked
against the image limits, then the engine's `prepare`: images, template, processor, cache keys) and queues it. The
one model thread ("deskeye-model") loads the engine, then takes batches from the queue after the load-adaptive wait
window (scheduler.py) and runs them; as each row ends its answer is validated against the request's JSON schema and
either answered or queued again, first in line, as a retry (retry.py). Loading on this thread keeps all CUDA state
on it, so `after_call` (torch.cuda.empty_cache) runs where it must.

Back-pressure and cancellation: at most `max_queue` accepted requests wait for the model (preparing or queued); one
more is refused at once (QueueFullError: 503 + Retry-After), so an accepted request is never dropped. A request
whose client went away or timed out is cancelled (`cancel`): its `Prepared.cancelled` event is set, so it is dropped
if it has not started decoding and the engine ends its row at the next step if it has; a cancelled row is never
retried. Its images stop decoding before the next one (images.py bounds the work of each, and of all of a request's
together, from their headers). A settled request lets go of its decoded images at once, and their freed pages go
back to the OS (heap_trim.py). A streamed request (`on_text`) gets text as the engine produces it and is never
retried once text was sent: a schema failure ends its stream with the error instead.

The seam with a continuously decoding engine: `run_batch(items, on_done, take_more)`. Between steps
`take_more(num_live)` hands it at once up to `max_batch_size - num_live` queued requests (retries first) to join the
decode, `on_done` indices continuing after the batch's. The window applies only to a batch that starts from idle.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError as FutureTimeout
from typing import Callable

from inference_worker.config import WorkerConfig
from inference_worker.engines.base import Engine, Prepared
from inference_worker.errors import CancelledError, ProtocolError, QueueFullError, ServiceError, one_line
from inference_worker.images import check_request_images
from inference_worker.metrics import WorkerMetrics
from inference_worker.protocol import ChatRequest, Completion
from inference_worker.schemas import output_problem
from inference_worker.serving.engine_metrics import count_completion, record_decode_stats, record_engine_stats
from inference_worker.serving.heap_trim import HeapTrim
from inference_worker.serving.job import Job, TextCallback, timeout_error
from inference_worker.serving.retry import retry_request
from inference_worker.serving.scheduler import BatchQueue, GpuUtilization, LoadSignals, WindowConfig, WindowPolicy

log = logging.getLogger("inference_worker")

Loader = Callable[[Callable[[str], None]], Engine]   # (progress callback) -> Engine

__all__ = ["Job", "ModelService", "ServiceError", "timeout_error"]   # re-exported: job.py, errors.py


class ModelService:
    """Owns the engine. States: loading -> ready -> stopped, or loading -> failed."""

    def __init__(self, load: Loader, config: WorkerConfig, *, metrics: WorkerMetrics,
                 on_ready: Callable[[Engine], None] = lambda engine: None,
                 on_failed: Callable[[str], None] = lambda error: None, gpu: GpuUtilization | None = None):
        """`on_ready(engine)` and `on_failed(load_error)` run on the model thread once the load ends, after
        `state` says so. `gpu` (tests) replaces the NVML reading the service sets up for a model on CUDA."""
        self._load = load
        self._config = config
        self._on_ready = on_ready
        self._on_failed = on_failed
        self._metrics = metrics
        window = WindowConfig.from_worker_config(config)
        self._signals = LoadSignals(window.horizon_s)
        self._window = WindowPolicy(window, self._signals, gpu)   # GPU reading added once a CUDA model loads
        self._queue = BatchQueue(1)                       # resized to the engine's batch size once loaded
        self._pool = ThreadPoolExecutor(config.preprocess_threads, thread_name_prefix="deskeye-prepare")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deskeye-model", daemon=True)
        self._waiting_lock = threading.Lock()
        self._num_waiting = 0
        self._heap_trim = HeapTrim()      # decoded pixels, and when to hand their freed pages back
        self.engine: Engine | None = None
        self.state = "loading"
        self.progress = "starting"
        self.load_error: str | None = None

    # ------------------------------------------------------------ HTTP-thread side

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: ChatRequest) -> Future:
        return self.submit_job(request).future

    def submit_job(self, request: ChatRequest, *, on_text: TextCallback | None = None,
                   on_queued: Callable[[], None] | None = None) -> Job:
        """Accept a request; raises ServiceError 503 (not ready) or QueueFullError (503 + Retry-After)."""
        if self.state != "ready":
            raise ServiceError(f"The model is not ready ({self.state}: {self.progress}); retry shortly.",
                               status=503, code="model_not_ready")
        job = Job(request, on_text=on_text, on_queued=on_queued)
        with self._waiting_lock:
            if self._num_waiting >= self._config.max_queue:
                self._metrics.rejected_busy.labels(reason="queue_full").inc()
                raise QueueFullError(self._config.max_queue)
            self._num_waiting += 1
            self._metrics.waiting.set(self._num_waiting)
        self._signals.request_started()
        job.future.add_done_callback(lambda _: self._signals.request_finished())
        job.future.add_done_callback(lambda _: self._stop_waiting(job))
        self._pool.submit(self._prepare, job)
        return job

    def answer(self, request: ChatRequest, timeout_s: float) -> Completion:
        """Submit and wait; raises ProtocolError/ServiceError (4xx/5xx) when there is no valid answer."""
        job = self.submit_job(request)
        try:
            return job.future.result(timeout=timeout_s)
        except FutureTimeout:
            self.cancel(job, f"no answer within {timeout_s:g} s")
            raise timeout_error(timeout_s) from None

    def cancel(self, job: Job, reason: str) -> None:
        """The client went away or timed out: drop the request if it is still waiting, end its row if it is
        decoding (the engine sees `Prepared.cancelled` at its next step). Any thread; idempotent."""
        if job.cancelled.is_set() or job.future.done():
            return
        job.cancelled.set()
        stage = "waiting" if job.is_waiting else "decoding"
        self._metrics.cancelled.labels(stage=stage).inc()
        log.debug("request cancelled while %s: %s", stage, reason)
        job.future.cancel()      # not running yet: done now (skipped when taken); running: the engine ends the
                                 # row and the service answers it with CancelledError, never a retry

    def _stop_waiting(self, job: Job) -> None:
        with self._waiting_lock:
            if job.is_waiting:
                job.is_waiting = False
                self._num_waiting -= 1
                self._metrics.waiting.set(self._num_waiting)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._queue.wake()                     # the model thread sleeps in take() until told
        self._pool.shutdown(wait=False)        # queued preparations still run and answer "shutting down"
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
        if self._window.gpu is not None:
            self._window.gpu.close()

    # ------------------------------------------------------------ preprocessing threads

    def _prepare(self, job: Job) -> None:
        if job.future.done() or job.cancelled.is_set():   # cancelled (gone, timed out) while waiting for a thread
            return
        if self._stop.is_set():
            self._settle(job, ServiceError("The worker is shutting down.", status=503, code="shutting_down"))
            return
        try:
            config = self._config        # the image limits, from the headers alone, whatever the engine does next
            check_request_images(job.request, config.max_image_pixels, config.max_request_pixels)
            job.prepared = self._with_callbacks(self.engine.prepare(job.request, job.cancelled), job)
        except CancelledError:                # cancelled while its images were decoded: nobody waits for it
            return
        except ProtocolError as exc:
            self._settle(job, exc)
            return
        except Exception as exc:  # noqa: BLE001 - a request the engine cannot prepare answers 500, alone
            log.warning("prepare failed: %s", _one_line(exc), exc_info=log.isEnabledFor(logging.DEBUG))
            self._settle(job, ServiceError(f"Could not prepare this request: {_one_line(exc)}", status=500,
                                           code="engine_error"))
            return
        self._heap_trim.count(job.prepared.images)
        if job.cancelled.is_set():            # cancelled while it was prepared: nobody waits for it
            return
        self._enqueue(job)
        if job.on_queued is not None:
            job.on_queued()

    def _with_callbacks(self, prepared: Prepared, job: Job) -> Prepared:
        """The job's cancellation event and text callback on its Prepared (a retry's replace keeps both)."""
        prepared.cancelled = job.cancelled
        if job.on_text is not None:
            prepared.on_text = lambda text: self._emit_text(job, text)
        return prepared

    def _emit_text(self, job: Job, text: str) -> None:
        """Hand generated text to a streamed request's callback (model thread); a failing callback (the client's
        side) never fails the batch: that request is cancelled instead."""
        if not text or job.cancelled.is_set():
            return
        job.num_text_chars += len(text)
        try:
            job.on_text(text)
        except Exception:  # noqa: BLE001 - one client's stream must not fail its neighbours
            log.warning("a stream's text callback failed; cancelling that request", exc_info=True)
            self.cancel(job, "its stream failed")

    def _enqueue(self, job: Job, *, front: bool = False) -> None:
        self._queue.put(job, front=front)
        self._metrics.queue_depth.set(len(self._queue))

    # ------------------------------------------------------------ model-thread side

    def _run(self) -> None:
        try:
            if not self._load_engine():
                return
            while not self._stop.is_set():
                batch = self._queue.take(self._window_s, self._stop,       # sleeps until a put or stop()
                                         expected_size=self._signals.recent_peak_in_flight)
                if batch is not None:
                    self._run_batch(batch)
        finally:
            self._fail_pending()
            self._close_engine()

    def _load_engine(self) -> bool:
        try:
            self.engine = self._load(self._set_progress)
        except Exception as exc:  # noqa: BLE001 - any load failure becomes a one-line message for the CLI
            log.debug("engine load failed", exc_info=True)
            self.load_error = _one_line(exc)
            self.state = "failed"
            self._on_failed(self.load_error)
            return False
        max_batch_size = self._config.max_batch_size if self.engine.can_batch else 1
        if self._window.gpu is None and getattr(self.engine.device, "type", "") == "cuda":
            self._window.gpu = GpuUtilization(self.engine.device.index or 0)
        self._queue = BatchQueue(max_batch_size)
        self._on_ready(self.engine)
        self.state = "ready" if not self._stop.is_set() else "stopped"
        self.progress = "ready"
        self._metrics.model_loaded.set(1)
        log.info("engine %s ready: %s (batches of up to %d)", self.engine.kind, self.engine.model_name,
                 max_batch_size)
        return True

    def _set_progress(self, message: str) -> None:
        self.progress = str(message)[:200]

    def _window_s(self) -> float:
        window_s = self._window.window_s(len(self._queue), self._queue.max_batch_size)
        self._metrics.batch_window.set(window_s)
        self._metrics.load_percent.set(self._window.last_load_pct)
        return window_s

    def _run_batch(self, batch) -> None:
        jobs = self._startable(batch)
        if not jobs:
            return
        self._metrics.batches.inc()
        started_s = time.monotonic()
        self._metrics.model_time.start()
        try:
            self.engine.run_batch([job.prepared for job in jobs], lambda index, outcome: self._row_done(
                jobs[index], outcome), lambda num_live: self._take_more(jobs, num_live))
        except Exception as exc:  # noqa: BLE001 - the batch failed: every row not yet answered gets the error
            self._engine_failed(jobs, exc)
        finally:
            self._after_call()
            self._heap_trim.after_batch()        # the batch's images are freed by now (`_settle`)
            self._metrics.model_time.count()
            self._metrics.batch_size.observe(len(jobs))      # the model call's requests, joiners included; last
            self._signals.batch_finished(time.monotonic() - started_s)

    def _startable(self, batch) -> list[Job]:
        """The batch's jobs that still want an answer (not cancelled while they waited), queue metrics kept."""
        jobs = [job for job in batch.items if self._starts(job)]
        self._metrics.queue_depth.set(len(self._queue))
        for job, wait_s in zip(batch.items, batch.queue_wait_s):
            job.queue_wait_s = wait_s
            self._metrics.queue_wait.observe(wait_s)
        return jobs

    def _take_more(self, jobs: list[Job], num_live: int) -> list[Prepared]:
        """Between decode steps (model thread): queued requests to join the running decode, without waiting;
        they are appended to `jobs`, so their indices follow. Also refreshes the decode metrics."""
        record_decode_stats(self._metrics, self.engine.stats())
        self._metrics.model_time.count()
        room = self._queue.max_batch_size - num_live
        if room <= 0 or self._stop.is_set() or not len(self._queue):
            return []
        joined = self._startable(self._queue.take_ready(room))
        jobs.extend(joined)
        return [job.prepared for job in joined]

    def _starts(self, job: Job) -> bool:
        """Whether a taken job decodes now: not if it was cancelled while it waited."""
        if job.retries:
            return not job.cancelled.is_set() or self._settle_cancelled(job)
        if not job.future.set_running_or_notify_cancel():     # cancelled while it waited: dropped
            job.prepared = None                                # its images and tensors go now, not at a GC
            return False
        self._stop_waiting(job)
        return True

    def _settle_cancelled(self, job: Job) -> bool:
        self._settle(job, CancelledError("the client went away or timed out"))
        return False

    def _row_done(self, job: Job, outcome: Completion | Exception) -> None:
        """One row ended (model thread): answer it, or queue it again as a retry. Nothing here escapes: a failure
        while judging the answer (e.g. validating it) is this row's error, never its batch's."""
        try:
            self._judge(job, outcome)
        except Exception as exc:  # noqa: BLE001 - one row's failure stays that row's
            log.warning("answering a row failed: %s", _one_line(exc), exc_info=log.isEnabledFor(logging.DEBUG))
            self._settle(job, ServiceError(f"The worker could not check this answer: {_one_line(exc)}", status=500,
                                           code="engine_error"))

    def _judge(self, job: Job, outcome: Completion | Exception) -> None:
        """Answer the row, or queue it again as a retry (never a cancelled row, nor a stream that sent text)."""
        if job.cancelled.is_set() or isinstance(outcome, CancelledError):
            self._metrics.engine_calls.labels(outcome="cancelled").inc()
            self._settle_cancelled(job)
            return
        if isinstance(outcome, Exception):
            self._engine_failed([job], outcome)
            return
        count_completion(self._metrics, outcome)
        schema = job.request.json_schema
        problem = output_problem(outcome, schema) if schema is not None else None
        if problem is None:
            self._answer(job, outcome)
        elif job.retries < self._config.max_retries and not job.num_text_chars:
            self._count_invalid(problem)
            job.retries += 1
            job.prepared = dataclasses.replace(job.prepared, request=retry_request(
                job.request, job.retries, self._config.max_tokens_limit))
            self._enqueue(job, front=True)
        elif outcome.finish_reason == "length":
            self._count_invalid(problem)        # out of room even after the retries: answered as it stands, like
            self._answer(job, outcome)          # any OpenAI server does, finish_reason "length" (ask with more)
        else:
            self._count_invalid(problem)
            self._metrics.schema_failures.inc()
            streamed = " (a streamed answer is not retried once text was sent)" if job.num_text_chars else ""
            self._settle(job, ServiceError(
                f"The model's answer did not match the requested JSON schema after {job.retries} retries"
                f"{streamed}: {problem}.", status=502, code="schema_mismatch"))

    def _answer(self, job: Job, completion: Completion) -> None:
        completion.retries = job.retries
        facts = completion.facts
        facts.engine = self.engine.kind
        facts.timing.queue_ms = round(job.queue_wait_s * 1000, 3)
        facts.timing.total_ms = round((time.monotonic() - job.arrived_s) * 1000, 3)
        self._settle(job, completion)

    def _settle(self, job: Job, outcome: Completion | Exception) -> None:
        job.prepared = None          # its images and tensors go now: the job itself lives on, in a cycle with its
                                     # future's callbacks, until a garbage collection
        self._metrics.retries.inc(job.retries)
        if job.future.done():                  # timed out and cancelled meanwhile
            return
        if isinstance(outcome, Exception):
            job.future.set_exception(outcome)
        else:
            job.future.set_result(outcome)

    def _engine_failed(self, jobs: list[Job], exc: Exception) -> None:
        if isinstance(exc, ProtocolError):      # the engine refused the request itself (e.g. a schema)
            self._metrics.engine_calls.labels(outcome="rejected").inc(len(jobs))
            error: Exception = exc
        else:
            log.warning("engine failed: %s", _one_line(exc), exc_info=log.isEnabledFor(logging.DEBUG))
            self._metrics.engine_calls.labels(outcome="error").inc(len(jobs))
            error = ServiceError(f"The engine failed on this request: {_one_line(exc)}", status=500,
                                 code="engine_error")
        for job in jobs:
            if not job.future.done():
                self._settle(job, error)

    def _after_call(self) -> None:
        record_engine_stats(self._metrics, self.engine.stats())
        try:
            self.engine.after_call()
        except Exception:  # noqa: BLE001 - hygiene failing must not fail the answer
            log.warning("engine.after_call failed", exc_info=True)
            return
        self._metrics.cache_releases.inc()
        self._metrics.advance_to(self._metrics.cuda_empty_cache, self.engine.stats().num_cuda_empty_cache_calls)

    def _count_invalid(self, problem: str) -> None:
        self._metrics.invalid_outputs.inc()
        log.debug("output rejected: %s", problem)

    def _fail_pending(self) -> None:
        for job in self._queue.drain():
            if job.retries or job.future.set_running_or_notify_cancel():
                self._settle(job, ServiceError("The worker is shutting down.", status=503, code="shutting_down"))

    def _close_engine(self) -> None:
        if self.state != "failed":
            self.state = "stopped"
        self._metrics.model_loaded.set(0)
        if self.engine is not None:
            try:
                self.engine.close()
            except Exception:  # noqa: BLE001
                log.warning("engine.close failed", exc_info=True)


def _one_line(exc: BaseException) -> str:
    return one_line(exc, max_chars=500)
