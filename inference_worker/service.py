"""The model thread: the one thread that loads the engine and calls it; HTTP threads submit jobs to it.

Loading on this thread keeps all CUDA state on it (so `after_call` can empty the cache where it must run).
A job is a validated request with its decoded images and a Future the HTTP thread waits on. The queue
hands the thread a list of jobs (one for now), so a later batching engine only changes `_take_jobs`.
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable

from inference_worker.constrained import SchemaMismatchError, complete_validated
from inference_worker.engines.base import Engine
from inference_worker.metrics import WorkerMetrics
from inference_worker.protocol import ChatRequest, Completion, ProtocolError

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
    images: list                        # decoded RGB PIL images, in request order
    future: Future = field(default_factory=Future)
    enqueued_at_s: float = field(default_factory=time.monotonic)


class ModelService:
    """Owns the engine. States: loading -> ready -> stopped, or loading -> failed."""

    def __init__(self, load: Loader, *, metrics: WorkerMetrics, max_retries: int, max_tokens_limit: int,
                 on_ready: Callable[[Engine], None] = lambda engine: None):
        self._load = load
        self._on_ready = on_ready
        self._metrics = metrics
        self._max_retries = max_retries
        self._max_tokens_limit = max_tokens_limit
        self._jobs: queue.Queue[Job] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deskeye-model", daemon=True)
        self.engine: Engine | None = None
        self.state = "loading"
        self.progress = "starting"
        self.load_error: str | None = None

    # ------------------------------------------------------------ HTTP-thread side

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: ChatRequest, images: list) -> Future:
        if self.state != "ready":
            raise ServiceError(f"The model is not ready ({self.state}: {self.progress}); retry shortly.",
                               status=503, code="model_not_ready")
        job = Job(request, images)
        self._jobs.put(job)
        self._metrics.queue_depth.set(self._jobs.qsize())
        return job.future

    def answer(self, request: ChatRequest, images: list, timeout_s: float) -> Completion:
        """Submit and wait; raises ServiceError (500/502/503/504) when there is no valid answer."""
        future = self.submit(request, images)
        try:
            return future.result(timeout=timeout_s)
        except FutureTimeout:
            future.cancel()
            raise ServiceError(f"The model did not answer within {timeout_s:g} s (--request-timeout-s); "
                               "it is busy or the request is too large.", status=504, code="timeout") from None

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    # ------------------------------------------------------------ model-thread side

    def _run(self) -> None:
        try:
            if not self._load_engine():
                return
            while not self._stop.is_set():
                for job in self._take_jobs():
                    self._serve(job)
        finally:
            self._fail_pending()
            self._close_engine()

    def _load_engine(self) -> bool:
        try:
            self.engine = self._load(self._set_progress)
            _freeze_long_lived_objects()
            self._on_ready(self.engine)
        except Exception as exc:  # noqa: BLE001 - any load failure becomes a one-line message for the CLI
            log.debug("engine load failed", exc_info=True)
            self.load_error = _one_line(exc)
            self.state = "failed"
            return False
        self.state = "ready" if not self._stop.is_set() else "stopped"
        self.progress = "ready"
        self._metrics.model_loaded.set(1)
        log.info("engine %s ready: %s", self.engine.kind, self.engine.model_name)
        return True

    def _set_progress(self, message: str) -> None:
        self.progress = str(message)[:200]

    def _take_jobs(self) -> list[Job]:
        try:
            job = self._jobs.get(timeout=POLL_INTERVAL_S)
        except queue.Empty:
            return []
        self._metrics.queue_depth.set(self._jobs.qsize())
        return [job] if job.future.set_running_or_notify_cancel() else []

    def _serve(self, job: Job) -> None:
        try:
            completion = complete_validated(
                lambda request: self._call_engine(request, job.images), job.request,
                max_retries=self._max_retries, max_tokens_limit=self._max_tokens_limit,
                on_invalid=self._count_invalid)
        except SchemaMismatchError as exc:
            self._metrics.retries.inc(exc.retries)
            self._metrics.schema_failures.inc()
            job.future.set_exception(ServiceError(str(exc), status=502, code="schema_mismatch"))
        except ProtocolError as exc:
            job.future.set_exception(exc)
        except Exception as exc:  # noqa: BLE001 - never let one request take the thread down
            log.exception("request failed")
            job.future.set_exception(ServiceError(f"Internal error: {_one_line(exc)}", status=500,
                                                  code="server_error"))
        else:
            self._metrics.retries.inc(completion.retries)
            completion.extra = {**completion.extra, "engine": self.engine.kind}
            job.future.set_result(completion)

    def _call_engine(self, request: ChatRequest, images: list) -> Completion:
        try:
            completion = self.engine.complete(request, images)
        except ProtocolError:        # the engine refused the request itself (e.g. a schema it cannot compile)
            self._metrics.engine_calls.inc(outcome="rejected")
            raise
        except Exception as exc:  # noqa: BLE001 - an engine failure answers this request with 500
            log.warning("engine failed: %s", _one_line(exc), exc_info=log.isEnabledFor(logging.DEBUG))
            self._metrics.engine_calls.inc(outcome="error")
            raise ServiceError(f"The engine failed on this request: {_one_line(exc)}", status=500,
                               code="engine_error") from None
        finally:
            self._after_call()
        self._metrics.engine_calls.inc(outcome="ok")
        self._metrics.prompt_tokens.inc(completion.prompt_tokens)
        self._metrics.completion_tokens.inc(completion.completion_tokens)
        return completion

    def _after_call(self) -> None:
        try:
            self.engine.after_call()
        except Exception:  # noqa: BLE001 - hygiene failing must not fail the answer
            log.warning("engine.after_call failed", exc_info=True)
            return
        self._metrics.cache_releases.inc()
        self._metrics.cuda_empty_cache.set(engine_stat(self.engine, "num_cuda_empty_cache_calls"))

    def _count_invalid(self, problem: str) -> None:
        self._metrics.invalid_outputs.inc()
        log.debug("output rejected: %s", problem)

    def _fail_pending(self) -> None:
        while not self._jobs.empty():
            job = self._jobs.get_nowait()
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(ServiceError("The worker is shutting down.", status=503,
                                                      code="shutting_down"))

    def _close_engine(self) -> None:
        if self.state != "failed":
            self.state = "stopped"
        self._metrics.model_loaded.set(0)
        if self.engine is not None:
            try:
                self.engine.close()
            except Exception:  # noqa: BLE001
                log.warning("engine.close failed", exc_info=True)


def _freeze_long_lived_objects() -> None:
    """Move the loaded model's objects out of the garbage collector's reach: the GC then never rescans
    them (hundreds of thousands with torch + transformers), so pauses while serving and the exit are short."""
    gc.collect()
    gc.freeze()


def engine_stat(engine: Engine, name: str) -> float:
    value: Any = getattr(engine, name, 0)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:500]
