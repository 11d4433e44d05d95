"""Two-stage answers with the real app under Xvfb: the OCR engine's first look on the overlay at once, then the
vision model's answer replaces it; hooks and memory take only the model's answer.

Everything is real: the app built by `build_app` (overlay, pynput hotkeys driven by xdotool, capture), its
`deskeye-worker` subprocesses (the tiny random Idefics3 model, and the small OCR worker the app starts beside it),
an external `deskeye-worker` serving the model at `worker.url` ("OCR local, model remote"), and a hook that runs a
real script. What the overlay showed is recorded in order from its `on_shown` callback, which the Tk thread calls
with what its widgets display after each change.

The tiny model answers in a fraction of a second, faster than any real one and than the OCR worker, so the tests
hold the model's process (SIGSTOP) from before the hotkey until the first look is on the overlay, then let it go
(SIGCONT): the order is observed, not raced. Its random weights answer nonsense, which is the point: its answer
is text the OCR engine cannot have written.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.fixtures.desktop import use_private_xdg_home

from deskeye.app import App
from deskeye.compose import build_app
from deskeye.errors import SettingsError
from deskeye.settings import settings_from_dict
from deskeye.worker.supervisor import HealthProbe, WorkerSupervisor
from tests.fixtures.polling import wait_until
from tests.fixtures.worker import running_worker

pytestmark = [pytest.mark.desktop, pytest.mark.model, pytest.mark.subprocess]

REGION_GEOMETRY = "800x600+560+240"        # the default capture region: 800x600 centred on 1920x1080
LINES = ["Quarterly report draft", "Revenue grew by twelve percent", "Costs are under review",
         "Meeting with finance on Friday", "Action items follow below"]
OCR_LINE = "Revenue grew by twelve percent"  # a line the OCR engine reads off the window
NO_AUTO_DESCRIBES = {"interval_s": 86_400.0}  # only the hotkey describes: one describe per test, nothing racing
FIRST_LOOK_TIMEOUT_S = 60.0                # generous: a shared, loaded 2-core machine (OCR takes ~0.3-3 s)
ANSWER_TIMEOUT_S = 180.0
HOOK_QUIET_S = 3.0                         # a second firing, if there were one, would come within this


def xdotool(*args: str) -> str:
    return subprocess.run(["xdotool", *args], capture_output=True, text=True, timeout=10).stdout.strip()


@pytest.fixture(scope="module")
def screen(xdisplay, tmp_path_factory):
    """The text window the app watches, in the default region; a private home for the apps' files."""
    from tests.fixtures.tk_windows import open_test_window

    home = tmp_path_factory.mktemp("home")
    restore_xdg = use_private_xdg_home(home)
    window = open_test_window(xdisplay, "Report - editor", REGION_GEOMETRY, lines=LINES)
    try:
        yield window
    finally:
        window.close()
        restore_xdg()


@pytest.fixture(scope="module")
def remote_model(tiny_idefics3_dir, tmp_path_factory):
    """An external OpenAI-compatible server: a `deskeye-worker` of its own serving the tiny model."""
    with running_worker(["--engine", "transformers", "--model", str(tiny_idefics3_dir), "--threads", "1"],
                        tmp_path_factory.mktemp("remote_model")) as handle:
        yield handle


class Hook:
    """A real hook: `record-hook` appends the JSON document it reads on stdin to `record-hook.fired`."""

    def __init__(self, folder: Path):
        self.script = folder / "record-hook"
        self.script.write_text('#!/bin/sh\ncat >> "$0.fired"\n', encoding="utf-8")
        self.script.chmod(0o755)
        self.fired = folder / "record-hook.fired"
        self.rules = folder / "hooks.toml"
        # any key object matches, and no cooldown: a firing on the first look as well would show as a second line
        self.rules.write_text(f'[[hook]]\nname = "record"\nregex = "."\nrun = ["{self.script}"]\ncooldown_s = 0\n',
                              encoding="utf-8")

    def settings(self, folder: Path) -> dict:
        return {"rules_file": str(self.rules), "audit_log": str(folder / "hooks.log")}

    def firings(self) -> list[dict]:
        if not self.fired.exists():
            return []
        return [json.loads(line) for line in self.fired.read_text(encoding="utf-8").splitlines() if line.strip()]


def start_app(tmp_path: Path, worker: dict, hook: Hook, **parts) -> App:
    settings = settings_from_dict({"capture": NO_AUTO_DESCRIBES, "overlay": {"fade_after_s": 0.0},
                                   "worker": {"startup_timeout_s": 150.0, "request_timeout_s": 120.0, **worker},
                                   "hooks": hook.settings(tmp_path)}, config_dir=tmp_path / "config")
    if worker.get("model"):
        # a held (SIGSTOPped) worker misses its health probes: the default probe would kill it after ~9 s
        parts.setdefault("supervisor", WorkerSupervisor(settings, probe=HealthProbe(max_missed=1000),
                                                        temp_root=tmp_path))
    app = build_app(settings, use_tray=False, temp_root=tmp_path, **parts)
    app.start()
    return app


def ocr_worker(app: App) -> WorkerSupervisor:
    """The OCR worker the app runs beside the model, once it serves (a first look needs it serving)."""
    part = getattr(app, "first_look", None)
    assert part is not None, "the app runs no OCR worker beside the model: there can be no first look"
    assert part.supervisor.endpoint(90).engine == "ocr"
    return part.supervisor


def stop_app(app: App) -> None:
    app.quit()
    assert app.wait(60), "the app did not stop"


def record_overlay(app: App) -> list:
    """Everything the overlay shows from now on, in order (hidden = not recorded)."""
    app.overlay.hide()
    assert app.overlay.wait_for(lambda shown: shown is None, 10) is None
    shown: list = []
    app.overlay.on_shown = lambda content: content is not None and shown.append(content)
    return shown


@contextlib.contextmanager
def held(pid: int):
    """The model's process stopped (SIGSTOP) for the block, then let go (SIGCONT): requests wait in its socket."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def final(shown: list):
    return next((content for content in shown if content.kind in ("answer", "error")), None)


def describe_in_two_stages(app: App, model_pid: int, hook: Hook):
    """Press the describe hotkey with the model held; return (first look, final answer, all that was shown)."""
    shown = record_overlay(app)
    with held(model_pid):
        xdotool("key", "ctrl+alt+d")
        first = wait_until(lambda: shown and shown[0], FIRST_LOOK_TIMEOUT_S)
        assert first, "nothing on the overlay while the model was held: no first look"
        assert first.kind == "first_look", shown
        assert OCR_LINE in first.summary, first          # the OCR engine's reading of this frame
        assert hook.firings() == [] and app.screen_memory.last() is None   # a first look is not an answer
    answer = wait_until(lambda: final(shown), ANSWER_TIMEOUT_S)
    assert answer is not None and answer.kind == "answer", shown
    return first, answer, list(shown)


def assert_model_answer_is_final(app: App, first, answer, shown: list, hook: Hook) -> None:
    kinds = [content.kind for content in shown]
    assert kinds[0] == "first_look" and kinds[-1] == "answer", kinds
    assert set(kinds[1:-1]) <= {"thinking"}, kinds        # the model's stream replaced the first look
    assert answer.summary and answer.summary != first.summary
    assert OCR_LINE not in answer.summary                 # the model's words, not the OCR engine's
    remembered = app.screen_memory.last()
    assert remembered is not None and remembered.summary == answer.summary
    assert remembered.key_objects, "the model's answer has no key object for the hook to match"
    assert wait_until(hook.firings, 30), "the hook never fired"
    time.sleep(HOOK_QUIET_S)
    firings = hook.firings()
    assert len(firings) == 1, firings                     # once, on the final answer
    assert firings[0]["summary"] == answer.summary
    assert firings[0]["key_objects"] == list(remembered.key_objects)


@pytest.mark.slow
def test_a_local_model_is_preceded_by_the_ocr_first_look_and_only_its_answer_fires_the_hook(
        screen, tiny_idefics3_dir, tmp_path):
    hook = Hook(tmp_path)
    app = start_app(tmp_path, {"engine": "transformers", "model": str(tiny_idefics3_dir)}, hook)
    try:
        model = app.supervisor.endpoint(150)
        assert model.engine == "transformers"
        ocr_worker(app)
        first, answer, shown = describe_in_two_stages(app, app.supervisor.pid, hook)
        assert_model_answer_is_final(app, first, answer, shown, hook)
        assert app.memory.turns()[-1].answer == answer.summary
    finally:
        stop_app(app)


@pytest.mark.slow
def test_an_external_model_is_preceded_by_a_local_ocr_first_look(screen, remote_model, tmp_path):
    hook = Hook(tmp_path)
    app = start_app(tmp_path, {"url": remote_model.url, "api_key": remote_model.api_key}, hook)
    try:
        ocr = ocr_worker(app)
        assert app.supervisor.is_external and app.supervisor.pid is None    # the model is remote ...
        local = psutil.Process(ocr.pid).cmdline()                           # ... the OCR worker local
        assert local[local.index("--engine") + 1] == "ocr"
        first, answer, shown = describe_in_two_stages(app, remote_model.proc.pid, hook)
        assert_model_answer_is_final(app, first, answer, shown, hook)
    finally:
        stop_app(app)


@pytest.mark.slow
def test_when_the_model_fails_the_first_look_stays_with_the_error_and_no_hook_fires(screen, tmp_path):
    with socket.socket() as probe:                     # a port nothing listens on: the model server is down
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    hook = Hook(tmp_path)
    app = start_app(tmp_path, {"url": f"http://127.0.0.1:{port}"}, hook)
    try:
        ocr_worker(app)
        shown = record_overlay(app)
        xdotool("key", "ctrl+alt+d")
        result = wait_until(lambda: final(shown), FIRST_LOOK_TIMEOUT_S)
        assert result is not None and result.kind == "error", shown
        assert OCR_LINE in result.summary and "First look (OCR)" in result.summary   # the first look stays ...
        assert f"Cannot reach the server at http://127.0.0.1:{port}" in result.summary   # ... the error under it
        time.sleep(HOOK_QUIET_S)
        assert hook.firings() == [] and app.screen_memory.last() is None
    finally:
        stop_app(app)


@pytest.mark.slow
def test_the_ocr_engine_alone_answers_in_one_stage(screen, tmp_path):
    hook = Hook(tmp_path)
    app = start_app(tmp_path, {"engine": "ocr"}, hook)
    try:
        assert getattr(app, "first_look", None) is None and app.supervisor.endpoint(90).engine == "ocr"
        workers = [p for p in psutil.Process().children(recursive=True)
                   if "inference_worker.cli" in " ".join(p.cmdline()) and str(tmp_path) in " ".join(p.cmdline())]
        assert len(workers) == 1                        # no second (OCR) worker beside it
        shown = record_overlay(app)
        xdotool("key", "ctrl+alt+d")
        answer = wait_until(lambda: final(shown), ANSWER_TIMEOUT_S)
        assert answer is not None and answer.kind == "answer" and OCR_LINE in answer.summary, shown
        assert "first_look" not in [content.kind for content in shown]
        assert wait_until(hook.firings, 30) and hook.firings()[0]["summary"] == answer.summary
    finally:
        stop_app(app)


def test_ocr_first_can_be_turned_off_and_is_checked_like_any_setting(xdisplay, tiny_idefics3_dir, tmp_path):
    off = settings_from_dict({"worker": {"model": str(tiny_idefics3_dir), "ocr_first": False}},
                             config_dir=tmp_path)
    on = settings_from_dict({"worker": {"model": str(tiny_idefics3_dir)}}, config_dir=tmp_path)
    assert on.worker.ocr_first is True                  # the default, with a model
    assert build_app(off, use_tray=False, use_hotkeys=False).first_look is None
    assert build_app(on, use_tray=False, use_hotkeys=False).first_look is not None
    with pytest.raises(SettingsError, match=r"worker\.ocr_first must be bool.*'yes'"):
        settings_from_dict({"worker": {"ocr_first": "yes"}})
