"""Worker memory: the RSS of a real worker (the tiny Idefics3 fixture, or the OCR engine) at its baseline, at its
peak during requests with large 16-bit PNGs, and after it has idled `--settle-s` seconds.

    python -m benchmarks.worker_memory                                   # 4 requests, 4 x 3840x2160 each, 60 s idle
    python -m benchmarks.worker_memory --size 7680x4320 --images-per-request 1
    python -m benchmarks.worker_memory --engine ocr --settle-s 30
    python -m benchmarks.worker_memory --size 7680x4320 --worker-args "--max-request-pixels 140000000"

The default request fills the worker's default per-request budget (--max-request-pixels: one 8K frame or four 4K
frames). The PNGs are smooth gradients, a few hundred KB on the wire, 16 bits per sample, so their cost is all in
decoding: ~4 bytes per pixel for PIL's RGB, more while the processor converts them. RSS is the worker process and
its children (preprocessing processes, if any), sampled every 20 ms during the requests for the peak and every
second while it idles; "settled" is the last sample, "settled min" the lowest.
"""

from __future__ import annotations

import argparse
import json
import shlex
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks._harness import process_tree_rss_mb

RESULTS = Path(__file__).resolve().parent / "results" / "worker_memory.json"
PEAK_SAMPLE_S = 0.02
SETTLE_SAMPLE_S = 1.0
ENGINES = ("idefics3", "ocr")


@dataclass
class MemoryResult:
    engine: str
    image_size: str                     # e.g. "3840x2160"
    images_per_request: int
    num_requests: int
    settle_s: float
    worker_args: list[str]
    baseline_rss_mb: float = 0.0        # after one small warm-up request
    peak_rss_mb: float = 0.0            # highest sample while the requests ran
    after_request_rss_mb: list[float] = field(default_factory=list)   # right after each answer
    statuses: list[int] = field(default_factory=list)
    request_s: list[float] = field(default_factory=list)
    settled_rss_mb: float = 0.0         # after `settle_s` seconds idle
    settled_min_rss_mb: float = 0.0
    settle_curve_mb: dict[int, float] = field(default_factory=dict)  # seconds idle -> RSS (every 10 s, and the end)
    kept_mb: float = 0.0                # settled - baseline: what the requests left behind
    first_error: str = ""


class PeakSampler:
    """A thread that samples the worker's RSS every PEAK_SAMPLE_S until stopped; `peak_mb` is the highest."""

    def __init__(self, pid: int):
        self.pid = pid
        self.peak_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-rss", daemon=True)

    def __enter__(self) -> "PeakSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_mb = max(self.peak_mb, process_tree_rss_mb(self.pid))
            self._stop.wait(PEAK_SAMPLE_S)


def measure(worker, *, size: tuple[int, int], images_per_request: int, num_requests: int, settle_s: float,
            engine: str = "idefics3", worker_args: list[str] | None = None) -> MemoryResult:
    """Send `num_requests` requests of `images_per_request` 16-bit PNGs of `size` to `worker`
    (tests.fixtures.worker.WorkerHandle) one after another, then let it idle `settle_s` seconds; RSS throughout."""
    from tests.fixtures.hostile_images import data_url, image_request, png16

    width, height = size
    result = MemoryResult(engine, f"{width}x{height}", images_per_request, num_requests, settle_s,
                          list(worker_args or []))
    bodies = [json.dumps(image_request([data_url(png16(width, height, seed=r * images_per_request + i), "image/png")
                                        for i in range(images_per_request)])).encode()
              for r in range(num_requests)]
    status, answer = worker.request("POST", "/v1/chat/completions", image_request(
        [data_url(png16(64, 48), "image/png")]))
    if status != 200:
        raise RuntimeError(f"the warm-up request failed: {status} {str(answer)[:300]}")
    time.sleep(SETTLE_SAMPLE_S)
    result.baseline_rss_mb = round(process_tree_rss_mb(worker.proc.pid), 1)
    with PeakSampler(worker.proc.pid) as sampler:
        for body in bodies:
            started_s = time.monotonic()
            status, answer = worker.request("POST", "/v1/chat/completions", raw=body, timeout_s=600)
            result.request_s.append(round(time.monotonic() - started_s, 2))
            result.statuses.append(status)
            result.after_request_rss_mb.append(round(process_tree_rss_mb(worker.proc.pid), 1))
            if status != 200 and not result.first_error:
                result.first_error = str(answer)[:500]
    result.peak_rss_mb = round(sampler.peak_mb, 1)
    _settle(worker.proc.pid, settle_s, result)
    result.kept_mb = round(result.settled_rss_mb - result.baseline_rss_mb, 1)
    return result


def _settle(pid: int, settle_s: float, result: MemoryResult) -> None:
    started_s = time.monotonic()
    samples = [process_tree_rss_mb(pid)]
    while (idle_s := time.monotonic() - started_s) < settle_s:
        time.sleep(min(SETTLE_SAMPLE_S, settle_s - idle_s))
        samples.append(process_tree_rss_mb(pid))
        whole_s = int(round(time.monotonic() - started_s))
        if whole_s % 10 == 0:
            result.settle_curve_mb[whole_s] = round(samples[-1], 1)
    result.settle_curve_mb[int(round(settle_s))] = round(samples[-1], 1)
    result.settled_rss_mb = round(samples[-1], 1)
    result.settled_min_rss_mb = round(min(samples), 1)


def print_table(result: MemoryResult) -> None:
    extra = f", worker args {' '.join(result.worker_args)}" if result.worker_args else ""
    print(f"Worker memory ({result.engine}): {result.num_requests} requests of {result.images_per_request} x "
          f"{result.image_size} 16-bit PNG, then {result.settle_s:g} s idle{extra}")
    print(f"{'phase':<26} {'RSS MB':>8}  status")
    print(f"{'baseline':<26} {result.baseline_rss_mb:>8.1f}")
    for index, (rss_mb, status, seconds) in enumerate(zip(result.after_request_rss_mb, result.statuses,
                                                          result.request_s)):
        print(f"{f'after request {index + 1} ({seconds:g} s)':<26} {rss_mb:>8.1f}  {status}")
    print(f"{'peak during requests':<26} {result.peak_rss_mb:>8.1f}")
    for idle_s, rss_mb in sorted(result.settle_curve_mb.items()):
        print(f"{f'idle {idle_s} s':<26} {rss_mb:>8.1f}")
    print(f"{'settled min':<26} {result.settled_min_rss_mb:>8.1f}")
    print(f"kept after {result.settle_s:g} s idle: {result.kept_mb:+.1f} MB over the baseline")
    if result.first_error:
        print(f"first error: {result.first_error}")


def _size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT, e.g. 3840x2160; got {text!r}") from None
    if width < 1 or height < 1:
        raise argparse.ArgumentTypeError(f"width and height must be positive; got {text!r}")
    return width, height


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=ENGINES, default="idefics3",
                        help="idefics3 = the tiny random Idefics3 fixture (its real processor); ocr = RapidOCR")
    parser.add_argument("--num-requests", type=int, default=4)
    parser.add_argument("--images-per-request", type=int, default=4)
    parser.add_argument("--size", type=_size, default=(3840, 2160), metavar="WxH")
    parser.add_argument("--settle-s", type=float, default=60.0, help="idle time after the requests (default 60)")
    parser.add_argument("--worker-args", default="", help="more deskeye-worker flags, as one shell-quoted string")
    parser.add_argument("--json-out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.num_requests < 1 or args.images_per_request < 1 or args.settle_s < 0:
        parser.error("--num-requests and --images-per-request must be >= 1, --settle-s >= 0")

    from benchmarks._results import write_result
    from tests.fixtures.worker import running_worker

    extra = shlex.split(args.worker_args)
    with tempfile.TemporaryDirectory(prefix="deskeye-worker-memory-") as tmp:
        if args.engine == "ocr":
            worker_args = ["--engine", "ocr"]
        else:
            from tests.fixtures.tiny_models import build_tiny_idefics3
            model = build_tiny_idefics3(Path(tmp) / "tiny-idefics3")
            worker_args = ["--engine", "transformers", "--model", str(model), "--threads", "1"]
        with running_worker([*worker_args, *extra], Path(tmp) / "worker") as worker:
            result = measure(worker, size=args.size, images_per_request=args.images_per_request,
                             num_requests=args.num_requests, settle_s=args.settle_s, engine=args.engine,
                             worker_args=extra)
    print_table(result)
    write_result(args.json_out, asdict(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
