"""`deskeye-worker` as a user meets it: documented options, one-line errors, a clean SIGTERM shutdown."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from inference_worker.cli import build_parser
from inference_worker.config import WorkerConfig
from tests.fixtures.worker import REPO_ROOT, start_worker, worker_env

pytestmark = [pytest.mark.model, pytest.mark.subprocess]

CONSOLE_SCRIPT = Path(sys.executable).parent / "deskeye-worker"


def run_cli(*args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "inference_worker.cli", *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=REPO_ROOT, env=worker_env())


def error_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr
    return [line for line in stderr.splitlines() if line.startswith("deskeye-worker: error:")]


def test_help_documents_every_config_field():
    result = subprocess.run([str(CONSOLE_SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    help_text = " ".join(result.stdout.split())
    actions = {action.dest: action for action in build_parser()._actions}
    for config_field in dataclasses.fields(WorkerConfig):
        action = actions.get(config_field.name)
        assert action is not None, f"WorkerConfig.{config_field.name} has no flag"
        assert action.help and len(action.help) > 20, f"{action.option_strings} has no real help text"
        assert action.option_strings[0] in help_text


def test_parsed_flags_build_the_config():
    args = build_parser().parse_args(["--engine", "ocr", "--no-grammar", "--threads", "1", "--max-retries", "0",
                                      "--state-file", "~/w.json", "--ground-with-ocr"])
    config = WorkerConfig(**{k: v for k, v in vars(args).items() if k != "verbose"})
    assert (config.engine, config.use_grammar, config.num_threads, config.max_retries) == ("ocr", False, 1, 0)
    assert config.ground_with_ocr and config.state_file == Path("~/w.json").expanduser()


@pytest.mark.parametrize("args, words", [
    (["--port", "http"], ["--port", "invalid int value"]),
    (["--engine", "gpu"], ["--engine", "invalid choice"]),
    (["--max-retries", "99"], ["--max-retries", "from 0 to 10"]),
    (["--engine", "transformers"], ["--model", "needs one"]),
    (["--max-image-pixels", "10"], ["--max-image-pixels"]),
    (["--prepare-processes", "17"], ["--prepare-processes", "from 0 to 16"]),
])
def test_bad_options_give_one_line_and_status_2(args, words):
    result = run_cli(*args)
    assert result.returncode == 2
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and result.stderr.strip() == lines[0]
    for word in words:
        assert word in lines[0]


@pytest.mark.slow
def test_missing_model_folder_is_a_one_line_error(tmp_path):
    missing = tmp_path / "no-such-model"
    state_file = tmp_path / "worker.json"
    result = run_cli("--engine", "transformers", "--model", str(missing), "--port", "0",
                     "--state-file", str(state_file))
    assert result.returncode == 1
    [line] = error_lines(result.stderr)
    assert str(missing) in line and "does not exist" in line
    assert not state_file.exists(), "the state file is removed when the worker gives up"


@pytest.mark.slow
def test_port_in_use_is_a_one_line_error(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli("--engine", "ocr", "--port", str(port), "--state-file", str(tmp_path / "w.json"))
    assert result.returncode == 1
    [line] = error_lines(result.stderr)
    assert f"127.0.0.1:{port}" in line and "in use" in line and "--port" in line


@pytest.mark.slow
def test_sigterm_stops_the_worker_cleanly_and_removes_the_state_file(tmp_path):
    """With the OCR engine (quick to start); test_worker_api's no-grammar worker checks the same with a model."""
    worker = start_worker(["--engine", "ocr"], tmp_path)
    assert json.loads(worker.state_file.read_text())["pid"] == worker.proc.pid
    started = time.monotonic()
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.proc.wait(timeout=15) == 0, worker.log_text()
    print(f"SIGTERM to exit: {time.monotonic() - started:.2f} s")
    assert not worker.state_file.exists()
    assert "Traceback" not in worker.log_text()
    with pytest.raises(OSError):
        socket.create_connection((worker.host, worker.port), timeout=2).close()


@pytest.mark.slow
def test_ocr_engine_loads_without_importing_torch():
    code = ("import sys; from inference_worker.config import WorkerConfig; "
            "from inference_worker.engines import load_engine; "
            "engine = load_engine(WorkerConfig(engine='ocr', ground_with_ocr=True)); "
            "print(engine.kind, type(engine).__name__, 'torch' in sys.modules, 'transformers' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=REPO_ROOT, env=worker_env())
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ocr", "OcrEngine", "False", "False"]   # no OCR-grounded OCR either


@pytest.mark.slow
def test_ground_with_ocr_wraps_the_model_engine(tiny_idefics3_dir):
    from inference_worker.engines import load_engine

    config = WorkerConfig(engine="transformers", model=str(tiny_idefics3_dir), num_threads=1, ground_with_ocr=True)
    engine = load_engine(config)
    try:
        assert type(engine).__name__ == "OcrGroundedEngine"
        assert engine.kind == "transformers" and engine.model_name == str(tiny_idefics3_dir)
    finally:
        engine.close()


@pytest.mark.slow
def test_a_live_workers_state_file_is_not_taken_over(tmp_path):
    state_file = tmp_path / "worker.json"
    state_file.write_text(json.dumps({"url": "http://127.0.0.1:1", "api_key": "x", "pid": os.getpid()}))
    result = run_cli("--engine", "ocr", "--state-file", str(state_file))
    assert result.returncode == 1
    [line] = error_lines(result.stderr)
    assert f"pid {os.getpid()}" in line and "--state-file" in line
    assert json.loads(state_file.read_text())["pid"] == os.getpid(), "the other worker's file is left alone"
