"""The worker's counters, gauges and histograms, rendered in the Prometheus text format for GET /metrics.

Small and thread-safe: every update takes one lock. Metrics are declared once in `WorkerMetrics`; label
values come from a fixed set (routes, status codes) so the series count stays bounded.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
QUEUE_WAIT_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.25, 0.5, 1.0, 2.5, 5.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def _format_labels(labels: tuple[tuple[str, str], ...]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _format_number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return str(int(value)) if float(value).is_integer() else repr(float(value))


@dataclass
class Counter:
    name: str
    help: str
    kind: str = "counter"
    _values: dict[tuple, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def set(self, value: float, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            self._values[key] = float(value)

    def value(self, **labels: str) -> float:
        with self._lock:
            return self._values.get(tuple(sorted(labels.items())), 0.0)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items()) or [((), 0.0)]
        return [f"{self.name}{_format_labels(k)} {_format_number(v)}" for k, v in items]


def Gauge(name: str, help: str) -> Counter:   # noqa: N802 - a gauge is a counter that may be set
    return Counter(name, help, kind="gauge")


@dataclass
class Histogram:
    name: str
    help: str
    buckets: tuple[float, ...] = LATENCY_BUCKETS_S
    kind: str = "histogram"
    _counts: list[int] = field(default_factory=list)
    _sum: float = 0.0
    _count: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self):
        self._counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        with self._lock:
            self._sum += value
            self._count += 1
            for i, bound in enumerate(self.buckets):
                if value <= bound:
                    self._counts[i] += 1

    def render(self) -> list[str]:
        with self._lock:
            counts, total, count = list(self._counts), self._sum, self._count
        lines = [f'{self.name}_bucket{{le="{_format_number(b)}"}} {c}' for b, c in zip(self.buckets, counts)]
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {count}')
        lines += [f"{self.name}_sum {_format_number(total)}", f"{self.name}_count {count}"]
        return lines


class WorkerMetrics:
    """Every metric the worker exports. One instance per process, shared by the HTTP and model threads."""

    def __init__(self):
        self.requests = Counter("deskeye_worker_requests_total", "HTTP requests answered, by route and status code.")
        self.latency = Histogram("deskeye_worker_request_duration_seconds",
                                 "Time to answer POST /v1/chat/completions, in seconds.")
        self.prompt_tokens = Counter("deskeye_worker_prompt_tokens_total", "Prompt tokens over all engine calls.")
        self.completion_tokens = Counter("deskeye_worker_completion_tokens_total",
                                         "Generated tokens over all engine calls (retries included).")
        self.engine_calls = Counter("deskeye_worker_engine_calls_total",
                                    "Answers the engine produced (one per request attempt), by outcome "
                                    "(ok | error | rejected).")
        self.batches = Counter("deskeye_worker_batches_total",
                               "Model calls: batches run by the model thread (each followed by after_call).")
        self.retries = Counter("deskeye_worker_retries_total",
                               "Re-generations after cut-off or schema-invalid JSON output.")
        self.invalid_outputs = Counter("deskeye_worker_invalid_outputs_total",
                                       "Engine outputs that were cut off or did not match the requested schema.")
        self.schema_failures = Counter("deskeye_worker_schema_failures_total",
                                       "Requests answered 502 because no attempt matched the schema.")
        self.cache_releases = Counter("deskeye_worker_cache_release_total",
                                      "engine.after_call runs (memory hygiene after every engine call).")
        self.cuda_empty_cache = Counter("deskeye_worker_cuda_empty_cache_total",
                                        "torch.cuda.empty_cache calls, as reported by the engine.")
        self.model_loaded = Gauge("deskeye_worker_model_loaded", "1 once the engine is loaded and serving, else 0.")
        self.queue_depth = Gauge("deskeye_worker_queue_depth", "Prepared requests waiting for the model thread.")
        self.batch_size = Histogram("deskeye_worker_batch_size",
                                    "Requests answered per model call (a continuous decode: those it started "
                                    "with and those that joined it).",
                                    buckets=BATCH_SIZE_BUCKETS)
        self.queue_wait = Histogram("deskeye_worker_queue_wait_seconds",
                                    "Time a prepared request waited in the queue before its batch started.",
                                    buckets=QUEUE_WAIT_BUCKETS_S)
        self.batch_window = Gauge("deskeye_worker_batch_window_seconds",
                                  "The current wait window: how long the first queued request waits for others.")
        self.load_percent = Gauge("deskeye_worker_load_percent",
                                  "The load the window is chosen from: GPU utilisation (NVML) blended with the "
                                  "worker's busy share and queue, 0-100.")
        self.kv_lookups = Counter("deskeye_worker_kv_cache_lookups_total",
                                  "Frame KV cache lookups by result (exact | similar | miss).")
        self.kv_bytes = Gauge("deskeye_worker_kv_cache_bytes", "Bytes of prefix KV kept for frames.")
        self.kv_entries = Gauge("deskeye_worker_kv_cache_entries", "Frames whose prefix KV is kept.")
        self.live_rows = Gauge("deskeye_worker_live_rows", "Rows the engine is decoding right now.")
        self.decode_steps = Counter("deskeye_worker_decode_steps_total",
                                    "Batched decode steps, as reported by the engine.")
        self.decode_row_steps = Counter("deskeye_worker_decode_row_steps_total",
                                        "Rows decoded summed over decode steps (/ steps = mean live rows).")
        self.kv_evictions = Counter("deskeye_worker_kv_cache_evictions_total",
                                    "Frames dropped from the KV cache to stay within --kv-cache-mb.")

    def all(self) -> list:
        return [v for v in vars(self).values() if isinstance(v, (Counter, Histogram))]

    def render(self) -> str:
        lines: list[str] = []
        for metric in self.all():
            lines += [f"# HELP {metric.name} {metric.help}", f"# TYPE {metric.name} {metric.kind}"]
            lines += metric.render()
        return "\n".join(lines) + "\n"


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {"name{labels}": value}; sample lines only. For tests and `deskeye doctor`."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples
