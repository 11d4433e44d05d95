"""The KV soak (benchmarks/kv_soak.py): 1,000 distinct frames against a real worker serving the tiny Idefics3 model
(~80 s on 2 cores). Once the frame cache is full the worker's RSS is flat, and it never grows past the budget
(plus the slack of a warming process). The budget is one the tiny model's ~190 KB entries fill by request ~130:
the default 512 MB would take ~2,900 frames to fill (see the benchmark's docstring)."""

from __future__ import annotations

import pytest

from benchmarks.kv_soak import soak
from tests.fixtures.worker import running_worker

pytestmark = [pytest.mark.model, pytest.mark.subprocess]

KV_CACHE_MB = 24
NUM_FRAMES = 1000


@pytest.mark.slow
def test_rss_is_flat_once_the_kv_cache_is_full(tiny_idefics3_dir, tmp_path):
    with running_worker(["--engine", "transformers", "--model", str(tiny_idefics3_dir), "--threads", "1",
                         "--kv-cache-mb", str(KV_CACHE_MB)], tmp_path) as worker:
        result = soak(worker, NUM_FRAMES, KV_CACHE_MB)
    last = NUM_FRAMES - 1
    assert result.first_eviction_at is not None and result.first_eviction_at < 150, result
    assert result.kv_bytes[last] <= KV_CACHE_MB * 2**20
    assert result.growth_pct_200_to_end <= 5.0, result          # measured: 0.1 %
    grown_mb = result.rss_mb[last] - result.rss_mb[0]
    assert grown_mb <= KV_CACHE_MB * 1.1 + 16, f"RSS grew {grown_mb:.1f} MB for a {KV_CACHE_MB} MB cache: {result}"


@pytest.mark.slow
def test_the_soak_benchmark_writes_its_table_and_json(tmp_path, capsys):
    import json

    from benchmarks import kv_soak

    out = tmp_path / "kv_soak.json"
    assert kv_soak.main(["--num-frames", "12", "--kv-cache-mb", "1", "--json-out", str(out)]) == 0
    report = json.loads(out.read_text(encoding="utf-8"))
    assert report["num_frames"] == 12 and report["first_eviction_at"] is not None
    assert set(report["rss_mb"]) >= {"0", "11"} and report["kv_bytes"]["11"] <= 2**20
    assert "RSS growth from request 200" in capsys.readouterr().out
