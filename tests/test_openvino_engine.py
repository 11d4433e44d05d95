"""The OpenVINO engine end to end: a tiny random LLaVA exported at test time by scripts/export_openvino.sh (in its
isolated export environment, built once per CI run inside the repo and reused), served by `deskeye-worker --engine
openvino`, asked by the official `openai` client. Nothing is faked: real export, real OpenVINO compile on the CPU,
real llguidance masks, real HTTP. The export runs once per test session (two formats: INT8 as served, FP32 for
comparing with the transformers engine on the very folder that was exported).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from deskeye.prompt import Turn, build_messages, deskeye_response_format
from inference_worker.engines.base import run_one
from tests.fixtures.chat_requests import chat_request, png_bytes
from tests.fixtures.openvino_models import build_exportable_llava, export_ir, export_side_by_side
from tests.fixtures.worker import REPO_ROOT, start_worker, worker_env

pytestmark = pytest.mark.timeout(1800)

SCHEMA = deskeye_response_format()["json_schema"]["schema"]


@pytest.fixture(scope="session")
def llava_source(tmp_path_factory) -> Path:
    return build_exportable_llava(tmp_path_factory.mktemp("ov_llava_source"))


@pytest.fixture(scope="session")
def exported(llava_source, tmp_path_factory) -> dict[str, Path]:
    """Both exports of the session, made side by side: each format's IR folder."""
    out = tmp_path_factory.mktemp("ov_ir")
    folders = {}
    for weight_format, done in export_side_by_side(llava_source, out, ("int8", "fp32")).items():
        assert done.returncode == 0, f"{weight_format} export failed:\n{done.stderr[-3000:]}"
        assert "[3/3] done" in done.stderr                  # the progress lines of the documented command
        folders[weight_format] = out / weight_format
    return folders


@pytest.fixture(scope="session")
def ir_int8(exported) -> Path:
    return exported["int8"]


@pytest.fixture(scope="session")
def ir_fp32(exported) -> Path:
    return exported["fp32"]


def _engine(folder: Path, cache_dir: Path, **options):
    from inference_worker.engines.openvino.engine import OpenVINOEngine
    from inference_worker.engines.openvino.runtime import RuntimeOptions
    keep_logits = options.pop("keep_logits", False)
    return OpenVINOEngine(folder, runtime=RuntimeOptions(cache_dir=cache_dir, **options), keep_logits=keep_logits)


# ------------------------------------------------------------------ the export

@pytest.mark.slow
def test_export_writes_int8_weights_a_third_of_fp32_or_less(llava_source, ir_int8, ir_fp32):
    for part in ("openvino_language_model", "openvino_vision_embeddings_model", "openvino_text_embeddings_model"):
        assert (ir_int8 / f"{part}.xml").is_file() and (ir_int8 / f"{part}.bin").is_file()
    xml = (ir_int8 / "openvino_language_model.xml").read_text(encoding="utf-8")
    assert 'element_type="i8"' in xml or 'element_type="u8"' in xml           # NNCF's compressed weights
    assert 'element_type="i8"' not in (ir_fp32 / "openvino_language_model.xml").read_text(encoding="utf-8")
    int8_bytes = sum(f.stat().st_size for f in ir_int8.glob("openvino_*_model.bin"))
    fp32_bytes = (llava_source / "model.safetensors").stat().st_size
    assert int8_bytes <= 0.3 * fp32_bytes, (int8_bytes, fp32_bytes)


@pytest.mark.slow
def test_export_refuses_an_unsupported_architecture_in_one_line(tiny_minicpmv46_dir, tmp_path, ir_int8):
    done = export_ir(tiny_minicpmv46_dir, tmp_path / "out")
    assert done.returncode == 3
    lines = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "MiniCPM-V 4.6" in lines[0] and "transformers engine" in lines[0]
    assert "Traceback" not in done.stderr and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_export_refuses_an_architecture_optimum_does_not_know(tmp_path, ir_int8):
    source = tmp_path / "odd"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"model_type": "deskeye_imaginary_vlm"}))
    done = export_ir(source, tmp_path / "out")
    assert done.returncode == 3 and "Traceback" not in done.stderr
    assert "'deskeye_imaginary_vlm' is not one optimum-intel exports" in done.stderr and "llava" in done.stderr


# ------------------------------------------------------------------ the runtime settings

@pytest.mark.slow
def test_compiled_model_reports_u8_kv_latency_physical_cores_and_fills_the_cache_dir(ir_int8, tmp_path):
    import platformdirs

    from inference_worker.engines.openvino.runtime import RuntimeOptions, physical_cores
    engine = _engine(ir_int8, tmp_path / "cache")
    language = engine.properties["openvino_language_model"]
    assert "uint8" in language["KV_CACHE_PRECISION"] or language["KV_CACHE_PRECISION"] == "u8"
    assert language["PERFORMANCE_HINT"] == "LATENCY"
    assert int(language["INFERENCE_NUM_THREADS"]) == physical_cores()
    assert list((tmp_path / "cache").glob("*.blob"))                       # compiled blobs kept for restarts
    assert RuntimeOptions().resolved_cache_dir == Path(platformdirs.user_cache_dir("deskeye")) / "openvino"
    engine.close()


# ------------------------------------------------------------------ answers

@pytest.mark.slow
def test_greedy_answers_match_the_transformers_engine_on_the_fp32_export(llava_source, ir_fp32, tmp_path):
    """Same weights (the folder that was exported), same prompt: identical greedy tokens, JSON and free text,
    with the u8 KV cache as served; first-step logits within 1e-4 of torch's (f32 inference: this CPU's default
    is bf16)."""
    import torch

    from inference_worker.engines import _resolve, family_for
    from inference_worker.engines.hf.engine import TransformersEngine
    from inference_worker.engines.hf.loading import LoadSpec, load_model

    loaded = load_model(LoadSpec(str(llava_source), "cpu", "fp32"), family_for, progress=False, resolve=_resolve)
    reference = TransformersEngine.from_loaded(loaded)
    engine = _engine(ir_fp32, tmp_path / "cache", inference_precision="f32", keep_logits=True)
    image = png_bytes((200, 30, 30))
    for schema, max_tokens in ((True, 60), (False, 40)):
        request, _ = chat_request("What is on this screen?", image, deskeye_schema=schema, max_tokens=max_tokens)
        want, got = run_one(reference, request), run_one(engine, request)
        assert got.text == want.text and got.completion_tokens == want.completion_tokens
    prompt = engine.prepare(request).inputs
    with torch.no_grad():
        torch_logits = loaded.model(input_ids=torch.from_numpy(prompt.input_ids),
                                    pixel_values=torch.from_numpy(prompt.pixel_values)).logits[0, -1].numpy()
    assert np.abs(got.facts.logits[0] - torch_logits).max() < 1e-4
    engine.close()


@pytest.mark.slow
def test_sampled_json_answers_are_all_schema_valid_and_the_frame_is_reused(ir_int8, tmp_path):
    engine = _engine(ir_int8, tmp_path / "cache")
    image = png_bytes((30, 200, 30))
    for seed in range(12):
        request, _ = chat_request("Describe it.", image, deskeye_schema=True, max_tokens=1024,
                                       temperature=1.0, top_p=0.95, seed=seed)
        answer = run_one(engine, request)
        assert answer.finish_reason == "stop" and answer.facts.constrained
        jsonschema.validate(json.loads(answer.text), SCHEMA)
        assert answer.facts.cache == ("exact" if seed > 0 else "miss")  # one vision encode for the same frame
    assert engine.stats().kv_entries == 1
    engine.close()


@pytest.mark.slow
def test_a_cancelled_row_stops_decoding(ir_int8, tmp_path):
    from inference_worker.engines.base import RowCancelled
    engine = _engine(ir_int8, tmp_path / "cache")
    request, _ = chat_request("Describe it.", png_bytes((1, 2, 3)), max_tokens=200)
    item = engine.prepare(request)
    item.cancelled.set()
    steps_before = engine.stats().num_decode_steps
    with pytest.raises(RowCancelled):
        engine.answer(item)
    assert engine.stats().num_decode_steps == steps_before
    engine.close()


@pytest.mark.slow
def test_worker_serves_the_ir_folder_to_the_openai_client(ir_int8, tmp_path):
    worker = start_worker(["--engine", "openvino", "--model", str(ir_int8), "--cache-dir", str(tmp_path / "c")],
                          tmp_path)
    try:
        assert worker.state["engine"] == "openvino"
        client = worker.openai_client()
        memory = [Turn(f"question {n}?", json.dumps({"summary": f"answer {n}", "key_objects": []}))
                  for n in range(3)]
        prompt_tokens = []
        for turns in (memory[:0], memory):                              # the three-turn memory, as the app sends it
            answer = client.chat.completions.create(
                model=worker.model, messages=build_messages("What is here?", png_bytes((10, 10, 200)), turns),
                response_format=deskeye_response_format(), max_tokens=120, temperature=0.8, seed=7)
            assert answer.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(answer.choices[0].message.content), SCHEMA)
            assert answer.model_extra["deskeye"]["engine"] == "openvino"
            prompt_tokens.append(answer.usage.prompt_tokens)
        assert prompt_tokens[1] > prompt_tokens[0] + 3 * 8              # the earlier turns are in the prompt
    finally:
        assert worker.stop() == 0


@pytest.mark.slow
def test_auto_picks_openvino_for_an_ir_folder(ir_int8, tmp_path):
    from inference_worker.config import WorkerConfig
    from inference_worker.engines import load_engine
    engine = load_engine(WorkerConfig(engine="auto", model=str(ir_int8), cache_dir=tmp_path / "cache"))
    assert engine.kind == "openvino"
    engine.close()


# ------------------------------------------------------------------ clear errors

def _start_and_fail(args: list[str], tmp_path: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "inference_worker.cli", "--port", "0",
                           "--state-file", str(tmp_path / "state.json"), *args],
                          capture_output=True, text=True, timeout=300, cwd=REPO_ROOT, env=worker_env())
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if "INFO:" not in line and line.strip()]   # "listening on"
    assert len(lines) == 1 and lines[0].startswith("deskeye-worker: error: could not load the engine: "), lines
    return lines[0]


@pytest.mark.slow
def test_a_transformers_folder_is_refused_in_one_line(llava_source, tmp_path):
    line = _start_and_fail(["--engine", "openvino", "--model", str(llava_source)], tmp_path)
    assert "is not an OpenVINO IR folder" in line and "export_openvino.sh" in line


@pytest.mark.slow
def test_an_ir_folder_of_another_family_is_refused_in_one_line(ir_int8, tmp_path):
    folder = shutil.copytree(ir_int8, tmp_path / "other")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "qwen2_vl"}))
    line = _start_and_fail(["--engine", "openvino", "--model", str(folder)], tmp_path)
    assert "'qwen2_vl' IR model" in line and "llava" in line


@pytest.mark.slow
def test_a_missing_ir_file_is_named_in_one_line(ir_int8, tmp_path):
    folder = shutil.copytree(ir_int8, tmp_path / "incomplete")
    (folder / "openvino_vision_embeddings_model.bin").unlink()
    line = _start_and_fail(["--engine", "openvino", "--model", str(folder)], tmp_path)
    assert "missing openvino_vision_embeddings_model.bin" in line and "export it again" in line


@pytest.mark.slow
def test_a_corrupt_cache_dir_costs_one_warning_line_and_the_worker_serves(ir_int8, tmp_path):
    """A CACHE_DIR that is a file: one warning naming it and the fix, then the worker compiles without it. Blobs
    overwritten with garbage: OpenVINO itself recompiles them (no line needed), and answers stay the same."""
    not_a_folder = tmp_path / "cache-file"
    not_a_folder.write_text("not a folder")
    worker = start_worker(["--engine", "openvino", "--model", str(ir_int8), "--cache-dir", str(not_a_folder)],
                          tmp_path / "w1")
    try:
        answer = worker.openai_client().chat.completions.create(
            model=worker.model, messages=build_messages("What?", png_bytes((5, 5, 5))), max_tokens=8)
        assert answer.choices[0].message.content is not None
    finally:
        worker.stop()
    log = worker.log_text()
    warnings = [line for line in log.splitlines() if "CACHE_DIR" in line]
    assert len(warnings) == 1 and str(not_a_folder) in warnings[0] and "is a file" in warnings[0]
    assert "Traceback" not in log

    cache = tmp_path / "cache"
    request, _ = chat_request("What?", png_bytes((5, 5, 5)), max_tokens=16)
    fresh = run_one(_engine(ir_int8, cache), request).text
    for blob in cache.glob("*.blob"):
        blob.write_bytes(np.random.default_rng(0).bytes(200))
    engine = _engine(ir_int8, cache)
    assert run_one(engine, request).text == fresh
    engine.close()


@pytest.mark.slow
def test_benchmark_runs_and_reports_every_target(llava_source, ir_int8, tmp_path):
    """benchmarks/openvino.py end to end on the session's export (small counts); speed itself is not asserted."""
    from benchmarks import openvino as bench
    out = tmp_path / "openvino.json"
    assert bench.main(["--ir", str(ir_int8), "--source", str(llava_source), "--requests", "3", "--decode-runs", "1",
                       "--restarts", "1", "--json-out", str(out)]) == 0
    report = json.loads(out.read_text(encoding="utf-8"))
    assert [row["target"] for row in report["targets"]] == [
        "decode tokens/s, OpenVINO INT8 / transformers", "IR size / FP32 weights",
        "schema-valid share of sampled answers", "warm CACHE_DIR start / cold compile"]
    assert all(isinstance(row["measured"], (int, float)) and isinstance(row["met"], bool) for row in report["targets"])
    assert report["schema"]["num_requests"] == 3 and report["decode"]["num_samples"]["openvino_int8"] >= 1
    assert report["restart"]["cold_s"] > 0 and report["restart"]["warm_s"] > 0


@pytest.mark.slow                # 1 s or more with the fixtures it sets up
def test_doctor_and_settings_know_the_openvino_engine(ir_int8, tmp_path):
    from deskeye.doctor import check_model
    from deskeye.settings import Settings, with_overrides
    ok = check_model(with_overrides(Settings(), worker={"engine": "openvino", "model": str(ir_int8)}))
    assert ok.is_ok and "OpenVINO IR model" in ok.detail
    auto = check_model(with_overrides(Settings(), worker={"model": str(ir_int8)}))
    assert auto.is_ok and "served by OpenVINO" in auto.detail
    broken = shutil.copytree(ir_int8, tmp_path / "broken")
    (broken / "openvino_language_model.bin").unlink()
    failed = check_model(with_overrides(Settings(), worker={"engine": "openvino", "model": str(broken)}))
    assert not failed.is_ok and "missing openvino_language_model.bin" in failed.detail
