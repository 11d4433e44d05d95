"""The GPU check (`python -m benchmarks.gpu_check`) waits for a lent CUDA machine; here it runs as CI can run it:
`--dry`, the same code at tiny sizes on the CPU, as a real subprocess with real workers. So a change that breaks it
(a renamed /metrics series, a builder the fixtures no longer fit, an engine the adapter no longer drives) fails
here, not on the GPU machine. Speed is never asserted: only that every number is there and sane."""

from __future__ import annotations

import json
import subprocess
import sys
from numbers import Number
from pathlib import Path

import pytest

from inference_worker.config import DEFAULT_BATCH_WINDOW_MS, DEFAULT_LOAD_THRESHOLDS_PCT
from tests.fixtures.processes import run_as_group
from tests.fixtures.worker import worker_env

pytestmark = [pytest.mark.model, pytest.mark.subprocess]

REPO_ROOT = Path(__file__).resolve().parents[1]
DRY_RUN_TIMEOUT_S = 280
MODELS = {"minicpmv46": "MiniCPM-V 4.6", "minicpmo45": "MiniCPM-o 4.5 LM"}
REAL_PARAMS = {"minicpmv46": 1_300_428_016, "minicpmo45": 8_190_735_360}


def _is_number(value) -> bool:
    return isinstance(value, Number) and not isinstance(value, bool)


def _run_check(*args: str, timeout_s: float = DRY_RUN_TIMEOUT_S) -> subprocess.CompletedProcess:
    return run_as_group([sys.executable, "-m", "benchmarks.gpu_check", *args], timeout_s, cwd=REPO_ROOT,
                        env=worker_env())


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path_factory.mktemp("gpu_check") / "gpu_check.json"
    proc = _run_check("--dry", "--json-out", str(out))
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}"
    return proc, json.loads(out.read_text(encoding="utf-8"))


@pytest.mark.slow
def test_dry_run_prints_every_row_and_passes_its_checks(dry_run):
    proc, report = dry_run
    concurrent = report["num_concurrent"]
    for title in MODELS.values():
        for row in ("one at a time", f"{concurrent} concurrent", f"in-process batch of {concurrent}"):
            assert f"{title} - {row}" in proc.stdout, (title, row, proc.stdout[-4000:])
    assert "no GPU: load window not measured" in proc.stdout
    assert "FAIL" not in proc.stdout
    assert all(c["ok"] for c in report["checks"]), report["checks"]
    assert {c["check"] for c in report["checks"]} == {
        f"{title}: {check}" for title in MODELS.values()
        for check in ("real size", "every request answered", "concurrent requests decoded together",
                      "no empty_cache without CUDA")}


@pytest.mark.slow                # 1 s or more with the fixtures it sets up
def test_dry_run_json_has_sane_numbers_for_both_models(dry_run):
    _, report = dry_run
    assert report["mode"] == "dry" and set(report["models"]) == set(MODELS)
    max_tokens, concurrent = report["max_tokens"], report["num_concurrent"]
    for key, part in report["models"].items():
        assert "error" not in part, part.get("error")
        assert part["num_params"] > 0 and part["dtype"] == "bfloat16"
        # the sizes the GPU run builds, counted on the meta device: MiniCPM-V 4.6 as published, Qwen3-8B's LM
        assert part["real_params"] == part["expected_real_params"] == REAL_PARAMS[key], part
        assert part["vocab_rows"] >= part["tokenizer_size"] > 0, part      # the head covers every token id
        worker = part["worker"]
        rows = [*worker["rows"], part["in_process"]["row"]]
        assert [r["label"] for r in rows] == [f"{MODELS[key]} - one at a time",
                                              f"{MODELS[key]} - {concurrent} concurrent",
                                              f"{MODELS[key]} - in-process batch of {concurrent}"]
        for row in rows:
            assert row["num_ok"] == row["num_requests"] and not row["errors"], row
            assert 1 <= row["tokens_per_request"] <= max_tokens, row
            for name in ("requests_per_s", "tokens_per_s", "model_ttft_p50_ms", "decode_tokens_per_s_p50"):
                assert _is_number(row[name]) and row[name] > 0, (name, row)
            assert row["torch_max_allocated_mib"] is None and row["vram_nvml_peak_mib"] is None, row   # no CUDA
        one, together, in_process = rows
        assert one["num_requests"] == report["num_one_at_a_time"] and one["mean_batch_size"] == 1
        assert together["num_requests"] == in_process["num_requests"] == concurrent
        assert 1 < together["mean_batch_size"] <= concurrent and in_process["mean_batch_size"] == concurrent
        for row in (one, together):                    # arrival -> first token holds the model's own part
            assert _is_number(row["ttft_p50_ms"]) and row["ttft_p50_ms"] >= row["model_ttft_p50_ms"], row
        assert _is_number(worker["throughput_ratio"]) and worker["throughput_ratio"] > 0
        calls = worker["empty_cache"]
        assert calls["empty_cache_calls"] == 0, calls               # no CUDA: the engine makes no empty_cache call
        assert calls["model_calls"] >= report["num_one_at_a_time"] + 1, calls
        assert worker["vram"]["nvml_worker_peak_mib"] is None and "not measured" in worker["vram"]["note"]


@pytest.mark.slow                # 1 s or more with the fixtures it sets up
def test_dry_run_reads_the_batch_window_but_says_the_gpu_load_was_not_measured(dry_run):
    _, report = dry_run
    window = report["models"]["minicpmv46"]["worker"]["load_window"]
    assert window["measured"] is False and window["gpu_busy"] is None and window["moved"] is None
    assert window["note"].startswith("no GPU: load window not measured")
    idle = window["idle"]                   # one request alone after a quiet spell: the lowest load level
    assert idle["request_ok"] and idle["load_percent"] < DEFAULT_LOAD_THRESHOLDS_PCT[0], idle
    assert idle["window_ms"] == DEFAULT_BATCH_WINDOW_MS[0], idle
    assert _is_number(window["concurrent"]["window_ms"]) and _is_number(window["concurrent"]["load_percent"])
    assert "load_window" not in report["models"]["minicpmo45"]["worker"]


@pytest.mark.slow
def test_without_cuda_and_without_dry_it_stops_at_once_saying_what_to_do():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU: the check would run")
    proc = _run_check(timeout_s=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "needs a CUDA GPU" in proc.stderr and "--dry" in proc.stderr, proc.stderr
    assert "row" not in proc.stdout                          # nothing was built or measured
