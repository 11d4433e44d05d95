"""What the service reads from an engine into the worker's metrics: each answered row's tokens and cache level,
and the engine's counters (EngineStats) after each model call and between decode steps. Counters only go up:
the engine's running totals advance them (`WorkerMetrics.advance_to`)."""

from __future__ import annotations

from inference_worker.engines.base import EngineStats
from inference_worker.metrics import WorkerMetrics
from inference_worker.protocol import CacheLevel, Completion

#: the cache levels of a row that looked its frame up (the kv_lookups metric's results)
LOOKUP_LEVELS = (CacheLevel.EXACT, CacheLevel.SIMILAR, CacheLevel.MISS)


def count_completion(metrics: WorkerMetrics, completion: Completion) -> None:
    """One row the engine answered: its tokens, and its frame-cache lookup (frame KV, or OpenVINO's vision
    features) when it made one."""
    metrics.engine_calls.labels(outcome="ok").inc()
    metrics.prompt_tokens.inc(completion.prompt_tokens)
    metrics.completion_tokens.inc(completion.completion_tokens)
    if completion.facts.cache in LOOKUP_LEVELS:
        metrics.kv_lookups.labels(result=completion.facts.cache.value).inc()


def record_engine_stats(metrics: WorkerMetrics, stats: EngineStats) -> None:
    """After a model call: the frame cache's size and evictions, and the decode counters."""
    metrics.kv_bytes.set(stats.kv_bytes)
    metrics.kv_entries.set(stats.kv_entries)
    metrics.advance_to(metrics.kv_evictions, stats.kv_evictions)
    record_decode_stats(metrics, stats)


def record_decode_stats(metrics: WorkerMetrics, stats: EngineStats) -> None:
    """Between decode steps and after a model call: rows decoding now, steps and row-steps so far."""
    metrics.live_rows.set(stats.live_rows)
    metrics.advance_to(metrics.decode_steps, stats.num_decode_steps)
    metrics.advance_to(metrics.decode_row_steps, stats.num_row_steps)
