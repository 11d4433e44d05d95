"""The worker gives back what large images cost it (benchmarks/worker_memory.py): after requests that fill the
per-request pixel budget with 16-bit 4K PNGs, a real worker serving the tiny Idefics3 model settles near its
baseline RSS instead of keeping every request's decoded images (measured before: +550 MB after four such requests,
still held after a minute idle; now about +50 MB)."""

from __future__ import annotations

import pytest

import json
from numbers import Number

from benchmarks import worker_memory
from benchmarks.worker_memory import measure
from tests.fixtures.worker import running_worker

pytestmark = [pytest.mark.model, pytest.mark.subprocess]

KEPT_LIMIT_MB = 150          # measured: +50 MB now, +420 MB after three requests before


@pytest.mark.slow
def test_rss_returns_near_its_baseline_after_requests_with_large_images(tiny_idefics3_dir, tmp_path):
    with running_worker(["--engine", "transformers", "--model", str(tiny_idefics3_dir), "--threads", "1"],
                        tmp_path) as worker:
        result = measure(worker, size=(3840, 2160), images_per_request=4, num_requests=3, settle_s=5.0)
    assert result.statuses == [200, 200, 200], result.first_error
    assert result.peak_rss_mb > result.baseline_rss_mb + 50, result       # the requests did decode their images
    assert result.kept_mb < KEPT_LIMIT_MB, f"kept {result.kept_mb:+.0f} MB after {result.settle_s:g} s idle: {result}"


@pytest.mark.slow
def test_the_memory_benchmark_writes_its_table_and_json(tmp_path, capsys):
    out = tmp_path / "worker_memory.json"
    assert worker_memory.main(["--num-requests", "2", "--images-per-request", "2", "--size", "1280x720",
                               "--settle-s", "2", "--json-out", str(out)]) == 0
    report = json.loads(out.read_text(encoding="utf-8"))
    assert report["statuses"] == [200, 200] and report["first_error"] == ""
    for key in ("baseline_rss_mb", "peak_rss_mb", "settled_rss_mb", "settled_min_rss_mb", "kept_mb"):
        assert isinstance(report[key], Number), (key, report)
    assert report["baseline_rss_mb"] > 0 and report["peak_rss_mb"] >= report["settled_min_rss_mb"] > 0
    assert len(report["after_request_rss_mb"]) == 2 and set(report["settle_curve_mb"]) == {"2"}
    table = capsys.readouterr().out
    for words in ("Worker memory (idefics3): 2 requests of 2 x 1280x720 16-bit PNG", "baseline", "peak during requests",
                  "kept after 2 s idle"):
        assert words in table, table
