"""The worker's counters, gauges and histograms, exported through `prometheus_client` for GET /metrics.

Each WorkerMetrics has its own registry (a process may hold several workers in tests). Counters only go up:
totals an engine keeps itself (CUDA empty_cache calls, KV evictions) are advanced to the engine's figure with
`advance_to`, never set. Label values come from fixed sets (routes, status codes, outcomes) so the series count
stays bounded.
"""

from __future__ import annotations

import math
import re
import threading
import time

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, disable_created_metrics,
                               generate_latest)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
QUEUE_WAIT_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.25, 0.5, 1.0, 2.5, 5.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST


class WorkerMetrics:
    """Every metric the worker exports. One instance per worker, shared by the HTTP and model threads."""

    def __init__(self):
        disable_created_metrics()       # no *_created series: a start time per series is noise for one worker
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)      # process_cpu_seconds_total, RSS, open fds (this process only)
        self._totals_lock = threading.Lock()
        self._totals: dict[int, float] = {}          # id(counter) -> the total advance_to last reached
        self._declare_requests()
        self._declare_model_calls()
        self._declare_batching()
        self._declare_kv_cache()

    def _declare_requests(self) -> None:
        """HTTP requests and what they were answered with."""
        counter, gauge, histogram = self._counter, self._gauge, self._histogram
        self.requests = counter("deskeye_worker_requests_total", "HTTP requests answered, by route and status code.",
                                ("code", "route"))
        self.latency = histogram("deskeye_worker_request_duration_seconds",
                                 "Time to answer POST /v1/chat/completions (to the last byte of a stream), in seconds.",
                                 LATENCY_BUCKETS_S)
        self.prompt_tokens = counter("deskeye_worker_prompt_tokens_total", "Prompt tokens over all engine calls.")
        self.completion_tokens = counter("deskeye_worker_completion_tokens_total",
                                         "Generated tokens over all engine calls (retries included).")
        self.engine_calls = counter("deskeye_worker_engine_calls_total",
                                    "Answers the engine produced (one per request attempt), by outcome "
                                    "(ok | error | rejected | cancelled).", ("outcome",))
        self.retries = counter("deskeye_worker_retries_total",
                               "Re-generations after cut-off or schema-invalid JSON output.")
        self.invalid_outputs = counter("deskeye_worker_invalid_outputs_total",
                                       "Engine outputs that were cut off or did not match the requested schema.")
        self.schema_failures = counter("deskeye_worker_schema_failures_total",
                                       "Requests answered 502 because no attempt matched the schema.")
        self.rejected_busy = counter("deskeye_worker_rejected_busy_total",
                                     "Requests answered 503 + Retry-After because the worker was full, by reason "
                                     "(queue_full | too_many_connections).", ("reason",))
        self.cancelled = counter("deskeye_worker_cancelled_total",
                                 "Requests cancelled because the client went away or timed out, by where they were "
                                 "(waiting | decoding).", ("stage",))
        self.streams = counter("deskeye_worker_streams_total", "Streamed answers (stream=true), by outcome "
                                                               "(ok | error | cancelled).", ("outcome",))
        self.open_requests = gauge("deskeye_worker_open_requests",
                                   "HTTP requests being served now; --max-connections bounds it.")

    def _declare_model_calls(self) -> None:
        """The model thread's calls: how many, their memory hygiene and where their time went."""
        counter, gauge = self._counter, self._gauge
        self.model_loaded = gauge("deskeye_worker_model_loaded", "1 once the engine is loaded and serving, else 0.")
        self.batches = counter("deskeye_worker_batches_total",
                               "Model calls: batches run by the model thread (each followed by after_call).")
        self.cache_releases = counter("deskeye_worker_cache_release_total",
                                      "engine.after_call runs (memory hygiene after every engine call).")
        self.cuda_empty_cache = counter("deskeye_worker_cuda_empty_cache_total",
                                        "torch.cuda.empty_cache calls, as reported by the engine.")
        self.model_time = ModelThreadTime(
            counter("deskeye_worker_model_busy_seconds_total",
                    "Wall time the model thread spent in model calls, in seconds."),
            counter("deskeye_worker_model_cpu_seconds_total",
                    "CPU time of the model thread during model calls, in seconds; what is left of the busy seconds "
                    "it waited for the GIL or for a core."))

    def _declare_batching(self) -> None:
        """The queue, the wait window and the running decode."""
        counter, gauge, histogram = self._counter, self._gauge, self._histogram
        self.queue_depth = gauge("deskeye_worker_queue_depth", "Prepared requests waiting for the model thread.")
        self.waiting = gauge("deskeye_worker_waiting_requests",
                             "Accepted requests not yet decoding (preparing or queued); --max-queue bounds it.")
        self.batch_size = histogram("deskeye_worker_batch_size",
                                    "Requests answered per model call (a continuous decode: those it started "
                                    "with and those that joined it).", BATCH_SIZE_BUCKETS)
        self.queue_wait = histogram("deskeye_worker_queue_wait_seconds",
                                    "Time a prepared request waited in the queue before its batch started.",
                                    QUEUE_WAIT_BUCKETS_S)
        self.batch_window = gauge("deskeye_worker_batch_window_seconds",
                                  "The current wait window: how long the first queued request waits for others.")
        self.load_percent = gauge("deskeye_worker_load_percent",
                                  "The load the window is chosen from: GPU utilisation (NVML) blended with the "
                                  "worker's busy share and queue, 0-100.")
        self.live_rows = gauge("deskeye_worker_live_rows", "Rows the engine is decoding right now.")
        self.decode_steps = counter("deskeye_worker_decode_steps_total",
                                    "Batched decode steps, as reported by the engine.")
        self.decode_row_steps = counter("deskeye_worker_decode_row_steps_total",
                                        "Rows decoded summed over decode steps (/ steps = mean live rows).")

    def _declare_kv_cache(self) -> None:
        """The frame KV cache."""
        counter, gauge = self._counter, self._gauge
        self.kv_lookups = counter("deskeye_worker_kv_cache_lookups_total",
                                  "Frame KV cache lookups by result (exact | similar | miss).", ("result",))
        self.kv_bytes = gauge("deskeye_worker_kv_cache_bytes", "Bytes of prefix KV kept for frames.")
        self.kv_entries = gauge("deskeye_worker_kv_cache_entries", "Frames whose prefix KV is kept.")
        self.kv_evictions = counter("deskeye_worker_kv_cache_evictions_total",
                                    "Frames dropped from the KV cache to stay within --kv-cache-mb.")

    def advance_to(self, counter: Counter, total: float) -> None:
        """Move an unlabelled counter up to `total`, a running total kept elsewhere (an engine's). A total that
        went down (an engine was replaced) restarts from there; the counter itself never goes down."""
        with self._totals_lock:
            last = self._totals.get(id(counter), 0.0)
            self._totals[id(counter)] = float(total)
            if total > last:
                counter.inc(total - last)

    def render(self) -> str:
        return generate_latest(self.registry).decode("utf-8")

    def _counter(self, name: str, help_text: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(name, help_text, labels, registry=self.registry)

    def _gauge(self, name: str, help_text: str) -> Gauge:
        return Gauge(name, help_text, registry=self.registry)

    def _histogram(self, name: str, help_text: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, help_text, buckets=buckets, registry=self.registry)


class ModelThreadTime:
    """The model thread's wall and CPU seconds in model calls, counted into two counters: `start` when a call
    begins, `count` at each decode step and when it ends, both on the model thread (time.thread_time is the calling
    thread's own CPU: torch's intra-op threads are not in it)."""

    def __init__(self, busy_seconds: Counter, cpu_seconds: Counter):
        self.busy_seconds, self.cpu_seconds = busy_seconds, cpu_seconds
        self._wall_s = self._cpu_s = 0.0

    def start(self) -> None:
        self._wall_s, self._cpu_s = time.monotonic(), time.thread_time()

    def count(self) -> None:
        """Add the time since the last start or count."""
        wall_s, cpu_s = time.monotonic(), time.thread_time()
        self.busy_seconds.inc(max(0.0, wall_s - self._wall_s))
        self.cpu_seconds.inc(max(0.0, cpu_s - self._cpu_s))
        self._wall_s, self._cpu_s = wall_s, cpu_s


_LE = re.compile(r'le="([^"]+)"')


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {"name{labels}": value}; sample lines only, bucket bounds written as the shortest
    number (le="1", not "1.0"). For tests and `deskeye doctor`."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[_LE.sub(lambda m: f'le="{_shortest(m.group(1))}"', name)] = float(value)
    return samples


def _shortest(bound: str) -> str:
    try:
        value = float(bound)
    except ValueError:
        return bound
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return str(int(value)) if value.is_integer() else repr(value)
