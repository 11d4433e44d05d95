"""KV soak: distinct frames, one after another, against a real worker serving the tiny Idefics3 model; the worker's
RSS is read at checkpoints. Once the frame cache is full (its first eviction), RSS must stay flat: every byte
the cache keeps is counted (tensors, thumbnails, bookkeeping) and freed heap pages go back to the OS.

    python -m benchmarks.kv_soak                    # 1,000 frames (~2-3 min on 2 cores)
    python -m benchmarks.kv_soak --num-frames 300   # shorter

The budget: the tiny model's entries really cost ~185 KB each (16 image tokens of KV, 27 KB, plus a 147 KB
thumbnail signature), so the worker's default 512 MB would take ~2,900 frames to fill; the soak uses a budget the
tiny model fills within the first ~150 frames (`--kv-cache-mb`, default 24) so that requests 200..N all run
with a full cache, which is what the default budget means for a real model with MBs of KV per frame.
"""

from __future__ import annotations

import argparse
import http.client
import io
import json
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "kv_soak.json"
DEFAULT_KV_CACHE_MB = 24
CHECKPOINT_EVERY = 50
FRAME_SIZE = (320, 240)


@dataclass
class SoakResult:
    num_frames: int
    kv_cache_mb: int
    first_eviction_at: int | None                  # request index of the first eviction (the cache is full)
    rss_mb: dict[int, float] = field(default_factory=dict)         # request index -> worker RSS
    kv_bytes: dict[int, float] = field(default_factory=dict)       # request index -> counted cache bytes
    kv_entries: dict[int, float] = field(default_factory=dict)
    growth_pct_200_to_end: float | None = None
    rss_per_entry_kb: float | None = None          # RSS growth / entries added, before the cache is full
    counted_per_entry_kb: float | None = None      # what the cache counts per entry
    seconds: float = 0.0


def distinct_frame(index: int) -> bytes:
    """A PNG no other index gives: an 8x6 grid of random colours, blown up (distinct at every scale the model
    and the similar-frame search look at, cheap to encode)."""
    import numpy as np
    from PIL import Image

    cells = np.random.default_rng(index).integers(0, 256, (6, 8, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(cells).resize(FRAME_SIZE, Image.NEAREST).save(buffer, "PNG")
    return buffer.getvalue()


def soak(worker, num_frames: int, kv_cache_mb: int) -> SoakResult:
    """Send `num_frames` distinct frames to `worker` (tests.fixtures.worker.WorkerHandle) and read its RSS."""
    import psutil

    from deskeye.prompt import build_messages

    process = psutil.Process(worker.proc.pid)
    result = SoakResult(num_frames, kv_cache_mb, None)
    started_s = time.monotonic()
    conn = http.client.HTTPConnection(worker.host, worker.port, timeout=120)
    try:
        for index in range(num_frames):
            body = {"model": "deskeye", "max_tokens": 4,
                    "messages": build_messages("What is on this screen?", distinct_frame(index))}
            conn.request("POST", "/v1/chat/completions", json.dumps(body),
                         {"Authorization": f"Bearer {worker.api_key}", "Content-Type": "application/json"})
            response = conn.getresponse()
            answer = response.read()
            if response.status != 200:
                raise RuntimeError(f"request {index}: {response.status} {answer[:300]!r}")
            if index % CHECKPOINT_EVERY == 0 or index == num_frames - 1 or result.first_eviction_at is None:
                _checkpoint(worker, process, index, result)
    finally:
        conn.close()
    result.seconds = round(time.monotonic() - started_s, 1)
    _summarise(result)
    return result


def _checkpoint(worker, process, index: int, result: SoakResult) -> None:
    metrics = worker.metrics()
    evictions = metrics.get("deskeye_worker_kv_cache_evictions_total", 0.0)
    if result.first_eviction_at is None and evictions > 0:
        result.first_eviction_at = index
    if index % CHECKPOINT_EVERY == 0 or index == result.num_frames - 1 or index == result.first_eviction_at:
        result.rss_mb[index] = round(process.memory_info().rss / 2**20, 1)
        result.kv_bytes[index] = metrics.get("deskeye_worker_kv_cache_bytes", 0.0)
        result.kv_entries[index] = metrics.get("deskeye_worker_kv_cache_entries", 0.0)


def _summarise(result: SoakResult) -> None:
    last = result.num_frames - 1
    if 200 in result.rss_mb:
        result.growth_pct_200_to_end = round(100 * (result.rss_mb[last] / result.rss_mb[200] - 1), 2)
    full = result.first_eviction_at
    if full is not None and full > CHECKPOINT_EVERY and result.kv_entries.get(full):
        added = result.kv_entries[full] - result.kv_entries[CHECKPOINT_EVERY]
        if added > 0:
            result.rss_per_entry_kb = round((result.rss_mb[full] - result.rss_mb[CHECKPOINT_EVERY]) * 1024 / added, 1)
        result.counted_per_entry_kb = round(result.kv_bytes[full] / result.kv_entries[full] / 1024, 1)


def print_table(result: SoakResult) -> None:
    print(f"KV soak: {result.num_frames} distinct frames, --kv-cache-mb {result.kv_cache_mb}, "
          f"cache full at request {result.first_eviction_at}, {result.seconds} s")
    print(f"{'request':>8} {'RSS MB':>8} {'counted KV MB':>14} {'entries':>8}")
    for index in sorted(result.rss_mb):
        print(f"{index:>8} {result.rss_mb[index]:>8.1f} {result.kv_bytes[index] / 2**20:>14.2f} "
              f"{int(result.kv_entries[index]):>8}")
    print(f"RSS growth from request 200 to {result.num_frames - 1}: {result.growth_pct_200_to_end} %")
    print(f"per entry before full: RSS {result.rss_per_entry_kb} KB, counted {result.counted_per_entry_kb} KB")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-frames", type=int, default=1000)
    parser.add_argument("--kv-cache-mb", type=int, default=DEFAULT_KV_CACHE_MB)
    parser.add_argument("--json-out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    from benchmarks._results import write_result
    from tests.fixtures.tiny_models import build_tiny_idefics3
    from tests.fixtures.worker import running_worker

    with tempfile.TemporaryDirectory(prefix="deskeye-kv-soak-") as tmp:
        model = build_tiny_idefics3(Path(tmp) / "tiny-idefics3")
        with running_worker(["--engine", "transformers", "--model", str(model), "--threads", "1",
                             "--kv-cache-mb", str(args.kv_cache_mb)], Path(tmp) / "worker") as worker:
            result = soak(worker, args.num_frames, args.kv_cache_mb)
    print_table(result)
    write_result(args.json_out, asdict(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
