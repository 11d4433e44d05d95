"""The model thread and what feeds it.

HTTP threads `submit` requests. A small pool prepares each one off the model thread (decodes its images, runs
the engine's `prepare`: template, processor, cache keys) and queues it. The one model thread ("deskeye-model")
loads the engine, then takes batches from the queue after the load-adaptive wait window (scheduler.py) and
runs them; as each row ends its answer is validated against the request's JSON schema and either answered or
queued again, first in line, as a retry. Loading on this thread keeps all CUDA state on it, so `after_call`
(torch.cuda.empty_cache) runs where it must.

The seam with a continuously decoding engine: `run_batch(items, on_done, take_more)`. Between decode steps the
engine calls `take_more(num_live)`; the service hands it, without waiting, up to `max_batch_size - num_live`
queued requests (retries first), which join the running decode; their `on_done` indices continue after the
batch's. The load-adaptive window applies only to a batch that starts from idle. A request whose job is
cancelled (`Job.cancel`: timed out here, or a client the HTTP layer saw go away) has its `Prepared.cancelled`
set: the engine ends its row at the next step, and it is never retried.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable

from inference_worker.config import WorkerConfig
from inference_worker.serving.validation import output_problem, retry_request
from inference_worker.engines.base import Engine, Prepared, RowCancelled
from inference_worker.serving.images import decode_request_images
from inference_worker.metrics import WorkerMetrics
from inference_worker.protocol import ChatRequest, Completion, ProtocolError
from inference_worker.serving.scheduler import BatchQueue, GpuUtilization, LoadSignals, WindowConfig, WindowPolicy

log = logging.getLogger("deskeye.worker")

POLL_INTERVAL_S = 0.2
Loader = Callable[[Callable[[str], None]], Engine]   # (progress callback) -> Engine


class ServiceError(ProtocolError):
    """A request the worker accepted but could not answer (engine failure, timeout, loading, 502 schema)."""

    def __init__(self, message: str, *, status: int, code: str):
        super().__init__(message, status=status, code=code)


@dataclass
class Job:
    request: ChatRequest
    future: Future = field(default_factory=Future)
    arrived_s: float = field(default_factory=time.monotonic)
    prepared: Prepared | None = None
    retries: int = 0
    queue_wait_s: float = 0.0
    #: set when the client went away or the request timed out; becomes the Prepared's `cancelled` event
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop this request: the engine ends its row at its next step; it is never retried or answered."""
        self.cancelled.set()
        self.future.cancel()

    @property
    def is_cancelled(self) -> bool:
        return self.cancelled.is_set() or self.future.cancelled()


class ModelService:
    """Owns the engine. States: loading -> ready -> stopped, or loading -> failed."""

    def __init__(self, load: Loader, config: WorkerConfig, *, metrics: WorkerMetrics,
                 on_ready: Callable[[Engine], None] = lambda engine: None, gpu: GpuUtilization | None = None):
        """`gpu` (tests) replaces the NVML reading the service sets up for a model on CUDA."""
        self._load = load
        self._config = config
        self._on_ready = on_ready
        self._metrics = metrics
        window = WindowConfig.from_worker_config(config)
        self._signals = LoadSignals(window.horizon_s)
        self._window = WindowPolicy(window, self._signals, gpu)   # GPU reading added once a CUDA model loads
        self._queue = BatchQueue(1)                       # resized to the engine's batch size once loaded
        self._pool = ThreadPoolExecutor(config.preprocess_threads, thread_name_prefix="deskeye-prepare")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deskeye-model", daemon=True)
        self.engine: Engine | None = None
        self.state = "loading"
        self.progress = "starting"
        self.load_error: str | None = None

    # ------------------------------------------------------------ HTTP-thread side

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: ChatRequest) -> Future:
        return self.submit_job(request).future

    def submit_job(self, request: ChatRequest) -> Job:
        """Queue `request` for preparation; the Job's future gets the answer, `Job.cancel()` stops it."""
        if self.state != "ready":
            raise ServiceError(f"The model is not ready ({self.state}: {self.progress}); retry shortly.",
                               status=503, code="model_not_ready")
        job = Job(request)
        self._signals.request_started()
        job.future.add_done_callback(lambda future: self._signals.request_finished())
        self._pool.submit(self._prepare, job)
        return job

    def answer(self, request: ChatRequest, timeout_s: float) -> Completion:
        """Submit and wait; raises ProtocolError/ServiceError (4xx/5xx) when there is no valid answer."""
        job = self.submit_job(request)
        try:
            return job.future.result(timeout=timeout_s)
        except FutureTimeout:
            job.cancel()
            raise ServiceError(f"The model did not answer within {timeout_s:g} s (--request-timeout-s); "
                               "it is busy or the request is too large.", status=504, code="timeout") from None

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._pool.shutdown(wait=False)        # queued preparations still run and answer "shutting down"
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
        if self._window.gpu is not None:
            self._window.gpu.close()

    # ------------------------------------------------------------ preprocessing threads

    def _prepare(self, job: Job) -> None:
        if job.future.done():                  # cancelled (timed out) while waiting for a thread
            return
        if self._stop.is_set():
            self._settle(job, ServiceError("The worker is shutting down.", status=503, code="shutting_down"))
            return
        try:
            images = decode_request_images(job.request, self._config.max_image_pixels)
            job.prepared = dataclasses.replace(self.engine.prepare(job.request, images), cancelled=job.cancelled)
        except ProtocolError as exc:
            self._settle(job, exc)
            return
        except Exception as exc:  # noqa: BLE001 - a request the engine cannot prepare answers 500, alone
            log.warning("prepare failed: %s", _one_line(exc), exc_info=log.isEnabledFor(logging.DEBUG))
            self._settle(job, ServiceError(f"Could not prepare this request: {_one_line(exc)}", status=500,
                                           code="engine_error"))
            return
        self._enqueue(job)

    def _enqueue(self, job: Job, *, front: bool = False) -> None:
        self._queue.put(job, front=front)
        self._metrics.queue_depth.set(len(self._queue))

    # ------------------------------------------------------------ model-thread side

    def _run(self) -> None:
        try:
            if not self._load_engine():
                return
            while not self._stop.is_set():
                batch = self._queue.take(self._window_s, self._stop, POLL_INTERVAL_S,
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
            return False
        max_batch_size = self._config.max_batch_size if self.engine.can_batch else 1
        device = self.engine.device
        if self._window.gpu is None and getattr(device, "type", "") == "cuda":
            self._window.gpu = GpuUtilization(device.index or 0)
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
        try:
            self.engine.run_batch([job.prepared for job in jobs], lambda index, outcome: self._row_done(
                jobs[index], outcome), lambda num_live: self._take_more(jobs, num_live))
        except Exception as exc:  # noqa: BLE001 - the batch failed: every row not yet answered gets the error
            self._engine_failed(jobs, exc)
        finally:
            self._after_call()
            self._metrics.batch_size.observe(len(jobs))      # the model call's requests, joiners included; last
            self._signals.batch_finished(time.monotonic() - started_s)

    def _startable(self, batch) -> list[Job]:
        """The batch's jobs that still want an answer (a retry's future is already running), queue metrics kept."""
        jobs = [job for job in batch.items if not job.is_cancelled
                and (job.retries or job.future.set_running_or_notify_cancel())]
        self._metrics.queue_depth.set(len(self._queue))
        for job, wait_s in zip(batch.items, batch.queue_wait_s):
            job.queue_wait_s = wait_s
            self._metrics.queue_wait.observe(wait_s)
        return jobs

    def _take_more(self, jobs: list[Job], num_live: int) -> list[Prepared]:
        """Between decode steps (model thread): queued requests to join the running decode, without waiting;
        they are appended to `jobs`, so their indices follow. Also refreshes the decode metrics."""
        self._update_decode_metrics()
        room = self._queue.max_batch_size - num_live
        if room <= 0 or self._stop.is_set() or not len(self._queue):
            return []
        joined = self._startable(self._queue.take_ready(room))
        jobs.extend(joined)
        return [job.prepared for job in joined]

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
        if isinstance(outcome, RowCancelled) or job.is_cancelled:
            self._metrics.engine_calls.inc(outcome="cancelled")
            self._settle(job, outcome if isinstance(outcome, Exception) else RowCancelled())
            return
        if isinstance(outcome, Exception):
            self._engine_failed([job], outcome)
            return
        self._count_completion(outcome)
        schema = job.request.json_schema
        problem = output_problem(outcome, schema) if schema is not None else None
        if problem is None:
            self._answer(job, outcome)
        elif job.retries < self._config.max_retries:
            self._count_invalid(problem)
            job.retries += 1
            job.prepared = dataclasses.replace(job.prepared, request=retry_request(
                job.request, job.retries, self._config.max_tokens_limit))
            self._enqueue(job, front=True)
        else:
            self._count_invalid(problem)
            self._metrics.schema_failures.inc()
            self._settle(job, ServiceError(
                f"The model's answer did not match the requested JSON schema after {job.retries} retries: "
                f"{problem}.", status=502, code="schema_mismatch"))

    def _answer(self, job: Job, completion: Completion) -> None:
        completion.retries = job.retries
        timing = {**completion.extra.get("timing", {}), "queue_ms": round(job.queue_wait_s * 1000, 3),
                  "total_ms": round((time.monotonic() - job.arrived_s) * 1000, 3)}
        completion.extra = {**completion.extra, "engine": self.engine.kind, "timing": timing}
        self._settle(job, completion)

    def _settle(self, job: Job, outcome: Completion | Exception) -> None:
        self._metrics.retries.inc(job.retries)
        if job.future.done():                  # timed out and cancelled meanwhile
            return
        if isinstance(outcome, Exception):
            job.future.set_exception(outcome)
        else:
            job.future.set_result(outcome)

    def _engine_failed(self, jobs: list[Job], exc: Exception) -> None:
        if isinstance(exc, ProtocolError):      # the engine refused the request itself (e.g. a schema)
            self._metrics.engine_calls.inc(len(jobs), outcome="rejected")
            error: Exception = exc
        else:
            log.warning("engine failed: %s", _one_line(exc), exc_info=log.isEnabledFor(logging.DEBUG))
            self._metrics.engine_calls.inc(len(jobs), outcome="error")
            error = ServiceError(f"The engine failed on this request: {_one_line(exc)}", status=500,
                                 code="engine_error")
        for job in jobs:
            if not job.future.done():
                self._settle(job, error)

    def _count_completion(self, completion: Completion) -> None:
        self._metrics.engine_calls.inc(outcome="ok")
        self._metrics.prompt_tokens.inc(completion.prompt_tokens)
        self._metrics.completion_tokens.inc(completion.completion_tokens)
        kv_cache = completion.extra.get("kv_cache")
        if kv_cache in ("exact", "similar", "miss"):
            self._metrics.kv_lookups.inc(result=kv_cache)

    def _after_call(self) -> None:
        self._update_cache_metrics()
        try:
            self.engine.after_call()
        except Exception:  # noqa: BLE001 - hygiene failing must not fail the answer
            log.warning("engine.after_call failed", exc_info=True)
            return
        self._metrics.cache_releases.inc()
        self._metrics.cuda_empty_cache.set(self.engine.stats().num_cuda_empty_cache_calls)

    def _update_cache_metrics(self) -> None:
        stats = self.engine.stats()
        self._metrics.kv_bytes.set(stats.kv_bytes)
        self._metrics.kv_entries.set(stats.kv_entries)
        self._metrics.kv_evictions.set(stats.kv_evictions)
        self._update_decode_metrics(stats)

    def _update_decode_metrics(self, stats=None) -> None:
        stats = stats or self.engine.stats()
        self._metrics.live_rows.set(stats.live_rows)
        self._metrics.decode_steps.set(stats.num_decode_steps)
        self._metrics.decode_row_steps.set(stats.num_row_steps)

    def _count_invalid(self, problem: str) -> None:
        self._metrics.invalid_outputs.inc()
        log.debug("output rejected: %s", problem)

    def _fail_pending(self) -> None:
        for job in self._queue.drain():
            if not job.is_cancelled and (job.retries or job.future.set_running_or_notify_cancel()):
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
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:500]
