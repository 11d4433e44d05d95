"""`deskeye describe` / `deskeye ask` as real subprocesses, with a settings file in a temp dir and XDG dirs
isolated, so the developer's real config is never read. No model is configured: the worker uses OCR.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.text_image import render_text_png

KEYS = {"summary", "key_objects", "engine", "latency_ms", "output_mode"}


@pytest.fixture
def cli(tmp_path):
    """Run `deskeye --settings <tmp>/settings.toml ARGS` in an isolated environment -> CompletedProcess."""
    settings = tmp_path / "settings.toml"
    settings.write_text("[worker]\nstartup_timeout_s = 60.0\nrequest_timeout_s = 60.0\n", encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "DESKEYE_"))}
    env.pop("DISPLAY", None)
    for name in ("XDG_CONFIG_HOME", "XDG_RUNTIME_DIR", "XDG_CACHE_HOME", "XDG_DATA_HOME"):
        (tmp_path / name).mkdir(mode=0o700)
        env[name] = str(tmp_path / name)
    env["HF_HUB_OFFLINE"] = "1"

    def run(*args: str, display: str | None = None) -> subprocess.CompletedProcess:
        run_env = {**env, "DISPLAY": display} if display else env
        return subprocess.run([sys.executable, "-m", "deskeye.cli", "--settings", str(settings), *args],
                              capture_output=True, text=True, timeout=120, env=run_env)
    return run


@pytest.fixture
def text_image(tmp_path) -> Path:
    path = tmp_path / "screen.png"
    path.write_bytes(render_text_png(["Quarterly budget review", "Meeting at 3pm"]))
    return path


def _no_traceback(proc: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout


def test_describe_image_json_prints_exactly_the_four_keys(cli, text_image):
    proc = cli("describe", "--image", str(text_image), "--json")
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.strip().splitlines()) == 1               # one JSON object, nothing else
    answer = json.loads(proc.stdout)
    assert set(answer) == KEYS
    assert answer["engine"] == "ocr" and answer["output_mode"] == "json_schema"
    summary = answer["summary"].lower()
    assert all(word in summary for word in ("quarterly", "budget", "review", "meeting")), answer
    assert isinstance(answer["key_objects"], list) and all(isinstance(k, str) for k in answer["key_objects"])
    assert isinstance(answer["latency_ms"], int) and answer["latency_ms"] > 0
    assert "starting the worker" in proc.stderr                     # progress goes to stderr
    _no_traceback(proc)


def test_ask_with_an_image_in_human_format(cli, text_image):
    proc = cli("ask", "What does the meeting line say?", "--image", str(text_image))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "budget" in lines[0].lower()
    assert lines[-1].startswith("(ocr, ") and lines[-1].endswith(" ms)")
    _no_traceback(proc)


def test_describe_a_region_of_the_real_screen(cli, open_window, xdisplay):
    """A real Tk window on Xvfb, grabbed with mss by `describe --region`, read by the OCR worker."""
    open_window("notes", "700x160+100+100", lines=["Deploy window closes Friday", "Invoice 4471 overdue"])
    proc = cli("describe", "--region", "100,100,700,160", "--json", display=xdisplay.name)
    assert proc.returncode == 0, proc.stderr
    answer = json.loads(proc.stdout)
    assert answer["engine"] == "ocr"
    assert "friday" in answer["summary"].lower() and "4471" in answer["summary"], answer


@pytest.mark.parametrize("make, expected", [
    (lambda d: d / "missing.png", "no such file"),
    (lambda d: d, "is a folder"),
    (lambda d: (d / "notes.png").write_text("not an image") and d / "notes.png", "not an image DeskEye can read"),
])
def test_a_bad_image_path_is_a_clear_error(cli, tmp_path, make, expected):
    path = make(tmp_path)
    proc = cli("describe", "--image", str(path), "--json")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.startswith(f"deskeye: --image {path}: {expected}")
    _no_traceback(proc)


def test_describe_the_screen_without_a_display_says_how_to_fix_it(cli):
    proc = cli("describe", "--json")
    assert proc.returncode == 1 and proc.stdout == ""
    assert "DISPLAY is not set" in proc.stderr and "--image FILE" in proc.stderr
    _no_traceback(proc)


def test_an_empty_question_is_a_usage_error(cli, text_image):
    proc = cli("ask", "  ", "--image", str(text_image))
    assert proc.returncode == 2 and "question is empty" in proc.stderr


def test_model_text_cannot_drive_the_terminal():
    from deskeye.client import printable
    assert printable("ok\x1b]0;pwned\x07 \x1b[2J done") == "ok\\x1b]0;pwned\\x07 \\x1b[2J done"
    assert printable("plain text 中文") == "plain text 中文"
