"""`deskeye doctor`: one OK/FAIL line per part, with how to fix it; exit 1 if anything failed."""

from __future__ import annotations

import pytest

import json
import os
import socket
import subprocess
import sys

from deskeye.doctor import NO_GPU, check_display, check_gpu, check_model, nvidia_smi_gpus, nvml_gpus
from deskeye.settings import Settings, with_overrides

pytestmark = [pytest.mark.desktop, pytest.mark.model, pytest.mark.subprocess]


def run_doctor(tmp_path, settings_text: str, display: str | None) -> subprocess.CompletedProcess:
    settings = tmp_path / "settings.toml"
    settings.write_text(settings_text, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "DESKEYE_", "DISPLAY", "WAYLAND_"))}
    for name in ("XDG_CONFIG_HOME", "XDG_RUNTIME_DIR", "XDG_CACHE_HOME"):
        (tmp_path / name).mkdir(mode=0o700, exist_ok=True)
        env[name] = str(tmp_path / name)
    env["HF_HUB_OFFLINE"] = "1"
    if display:
        env["DISPLAY"] = display
    return subprocess.run([sys.executable, "-m", "deskeye.cli", "--settings", str(settings), "doctor"],
                          capture_output=True, text=True, timeout=120, env=env)


def lines_by_name(stdout: str) -> dict[str, str]:
    """{"display": "OK    display  X display :5 reachable", ...}"""
    return {line.split()[1]: line for line in stdout.splitlines()}


@pytest.mark.slow
def test_everything_ok_under_xvfb(tmp_path, xdisplay):
    proc = run_doctor(tmp_path, "[worker]\nstartup_timeout_s = 60.0\n", xdisplay.name)
    lines = lines_by_name(proc.stdout)
    assert list(lines) == ["display", "capture", "hotkeys", "gpu", "model", "worker"], proc.stdout
    assert lines["display"].startswith("OK") and f"X display {xdisplay.name} reachable" in lines["display"]
    assert lines["capture"].startswith("OK") and "grabbed 800x600 at 560,240 of monitor 1" in lines["capture"]
    assert f"with mss on the X display {xdisplay.name}" in lines["capture"]          # the session's backend
    assert "X11 session" in lines["display"]
    assert lines["model"].startswith("OK") and "none configured: using the OCR engine" in lines["model"]
    assert lines["worker"].startswith("OK") and "engine ocr" in lines["worker"], proc.stdout
    assert lines["gpu"].startswith("OK")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_without_display_it_fails_with_a_fix_and_exit_1(tmp_path):
    with socket.socket() as probe:                       # an external server that is not running
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    proc = run_doctor(tmp_path, f'[worker]\nurl = "{url}"\n', display=None)
    lines = lines_by_name(proc.stdout)
    assert proc.returncode == 1
    assert lines["display"].startswith("FAIL") and "DISPLAY is not set" in lines["display"]
    assert "Run DeskEye inside your desktop session" in lines["display"]
    assert lines["capture"].startswith("FAIL") and "DISPLAY is not set" in lines["capture"]
    assert lines["worker"].startswith("FAIL") and f"cannot reach the external server at {url}" in lines["worker"]
    assert "Traceback" not in proc.stdout + proc.stderr


def test_an_unreachable_display_fails(monkeypatch):
    monkeypatch.setenv("DISPLAY", ":9876")
    result = check_display(Settings())
    assert not result.is_ok and "cannot open the X display ':9876'" in result.detail


def test_gpu_line_matches_this_machine():
    gpus = nvml_gpus() or nvidia_smi_gpus()
    auto = check_gpu(Settings())
    cuda = check_gpu(with_overrides(Settings(), worker={"device": "cuda"}))
    if gpus:
        assert auto.is_ok and cuda.is_ok and auto.detail.startswith("GPU 0: ")
    else:
        assert auto.is_ok and auto.detail == NO_GPU
        assert not cuda.is_ok and 'set worker.device = "auto"' in cuda.detail


def _model(**worker):
    return check_model(with_overrides(Settings(), worker=worker))


def test_model_checks_are_cheap_file_checks(tmp_path, monkeypatch):
    """Only file presence is checked (no load), so placeholder files stand in for weights here."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    result = _model(model=str(folder))
    assert not result.is_ok and "weights (*.safetensors)" in result.detail and "tokenizer" in result.detail

    (folder / "tokenizer.json").write_text("{}")
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    result = _model(model=str(folder))
    assert not result.is_ok and "model-00002-of-00002.safetensors" in result.detail
    assert "model-00001" not in result.detail

    (folder / "model-00002-of-00002.safetensors").write_bytes(b"")
    assert _model(model=str(folder)).is_ok

    result = _model(model="someorg/not-downloaded")
    assert not result.is_ok and "hf download someorg/not-downloaded" in result.detail
    result = _model(model=str(tmp_path / "typo"))
    assert not result.is_ok and "no such folder" in result.detail
    result = _model(engine="transformers")
    assert not result.is_ok and "worker.model is empty" in result.detail
    assert _model().detail == "none configured: using the OCR engine"


def test_a_real_tiny_model_folder_is_complete(tiny_idefics3_dir):
    result = check_model(with_overrides(Settings(), worker={"model": str(tiny_idefics3_dir)}))
    assert result.is_ok, result.detail
