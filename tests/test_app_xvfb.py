"""The desktop app end to end on a real X server (Xvfb): real mss grabs, a real pynput listener driven by
xdotool, the real Tk overlay, real tray actions, and a real `deskeye-worker --engine ocr` subprocess started
and restarted by the app's supervisor. Requests are counted AT THE WORKER (its GET /metrics counter).

One app serves the whole module (starting the worker and the OCR model is the slow part); the tests run in
file order and each leaves the app running, unpaused, with a quiet screen. The last one quits it.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import psutil
import pytest

from tests.fixtures.desktop import use_private_xdg_home

from deskeye.app import App
from deskeye.compose import build_app
from deskeye.ui.ask_box import ASK_TITLE
from deskeye.ui.overlay import WINDOW_TITLE
from deskeye.settings import settings_from_dict
from inference_worker.metrics import parse_metrics
from tests.fixtures.polling import wait_until

pytestmark = [pytest.mark.desktop, pytest.mark.subprocess]

REGION_GEOMETRY = "800x600+560+240"        # the default capture region: 800x600 centred on 1920x1080
LINES = ["Quarterly report draft", "Revenue grew by twelve percent", "Costs are under review",
         "Meeting with finance on Friday", "Action items follow below"]
INTERVAL_S = 0.3
QUICK_QUESTION = "what time is it"
STANDARD_QUESTION = "what does the third line on my screen say?"
DEEP_QUESTION = "explain in detail how the revenue and cost figures on this report relate and what they imply"
QUIET_S = 1.5                              # five capture ticks


def xdotool(*args: str) -> str:
    return subprocess.run(["xdotool", *args], capture_output=True, text=True, timeout=10).stdout.strip()


def chat_requests(app: App) -> int:
    """POST /v1/chat/completions requests the current worker process has answered (any status)."""
    endpoint = app.supervisor.endpoint(60)
    request = urllib.request.Request(f"{endpoint.url}/metrics",
                                     headers={"Authorization": f"Bearer {endpoint.api_key}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        samples = parse_metrics(response.read().decode())
    return int(sum(v for k, v in samples.items()
                   if k.startswith("deskeye_worker_requests_total") and "chat/completions" in k))


def settle(app: App, timeout_s: float = 30.0) -> int:
    """Wait until the app is idle and the worker's count stays put for QUIET_S; return the count."""
    deadline = time.monotonic() + timeout_s
    count = chat_requests(app)
    quiet_since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = chat_requests(app)
        busy = app._busy.is_set() or app.jobs.has_auto_waiting()
        if now != count or busy:
            count, quiet_since = now, time.monotonic()
        elif time.monotonic() - quiet_since >= QUIET_S:
            return count
    raise AssertionError("the app never went quiet")


def read_line_starting(proc: subprocess.Popen, prefix: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and select.select([proc.stdout], [], [], deadline - time.monotonic())[0]:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith(prefix):
            return line
    return ""


def clear_overlay(app: App) -> None:
    app.overlay.hide()
    assert app.overlay.wait_for(lambda s: s is None, 5) is None


def press_describe_and_wait(app: App, timeout_s: float = 60.0):
    clear_overlay(app)
    xdotool("key", "ctrl+alt+d")
    shown = app.overlay.wait_for(lambda s: s is not None and s.kind != "thinking", timeout_s)
    assert shown is not None, "the hotkey press got neither an answer nor an error in the overlay"
    return shown


THREADS_BEFORE_APP: set[threading.Thread] = set()


@pytest.fixture(scope="module")
def desktop(xdisplay, tmp_path_factory):
    """The text window the app watches, then the app (its worker, hotkeys, tray and overlay)."""
    from tests.fixtures.tk_windows import open_test_window

    home = tmp_path_factory.mktemp("home")
    restore_xdg = use_private_xdg_home(home)
    THREADS_BEFORE_APP.update(threading.enumerate())   # the test process runs other files' tests too
    window = open_test_window(xdisplay, "Report - editor", REGION_GEOMETRY, lines=LINES)
    settings = settings_from_dict({
        "capture": {"interval_s": INTERVAL_S, "extra_excluded_titles": ["Secret Vault"]},
        "overlay": {"fade_after_s": 0.0},
        "worker": {"engine": "ocr", "startup_timeout_s": 90.0, "request_timeout_s": 60.0},
        "hooks": {"dry_run": True},
    }, config_dir=home / "config")
    app = build_app(settings)
    app.start()
    try:
        yield app, window
    finally:
        app.quit()
        app.wait(30)
        window.close()
        restore_xdg()


@pytest.mark.slow
def test_an_unchanged_screen_sends_no_request_and_a_changed_line_sends_one(desktop):
    app, window = desktop
    first = settle(app, timeout_s=120)           # the first frame of the window has been described
    assert first >= 1
    time.sleep(QUIET_S)
    assert chat_requests(app) == first           # five more ticks of the same screen: nothing sent

    clear_overlay(app)
    window.set_line(2, "Costs were cut by a third")
    assert wait_until(lambda: chat_requests(app) >= first + 1, 30)
    assert settle(app) == first + 1              # exactly one request for the one change
    shown = app.overlay.wait_for(lambda s: s is not None, 10)
    assert shown is not None and shown.kind == "answer"   # the overlay says what is there now
    assert "Costs were cut by a third" in shown.summary


@pytest.mark.slow
def test_hotkey_shows_the_worker_summary_at_the_bottom_right_without_taking_focus(desktop, xdisplay):
    app, window = desktop
    window.focus()
    before = settle(app)
    shown = press_describe_and_wait(app)
    assert shown.kind == "answer"
    assert "Revenue grew by twelve percent" in shown.summary        # the OCR engine read the screen
    assert settle(app) == before + 1
    assert app.screen_memory.last().summary == shown.summary        # the overlay shows the worker's summary
    assert app.memory.turns()[-1].answer == shown.summary

    window_id = wait_until(lambda: xdotool("search", "--onlyvisible", "--name", WINDOW_TITLE), 5).split()[0]
    info = subprocess.run(["xwininfo", "-id", window_id], capture_output=True, text=True).stdout
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in info.splitlines()) if v}
    width = int(fields["Width"])
    margin = app.settings.overlay.margin_px
    assert int(fields["Absolute upper-left X"]) + width + margin == xdisplay.width
    assert int(fields["Absolute upper-left Y"]) + int(fields["Height"]) + margin == xdisplay.height
    assert xdotool("getwindowfocus", "getwindowname") == "Report - editor"


@pytest.mark.slow
def test_an_excluded_window_sends_no_request(desktop, open_window):
    app, window = desktop
    before = settle(app)
    vault = open_window("Secret Vault - passwords", "400x200+100+100", lines=["hunter2"])
    vault.focus()
    window.set_line(3, "Meeting moved to Monday")             # the watched region changes...
    time.sleep(QUIET_S)
    shown = press_describe_and_wait(app, timeout_s=10)         # ...and the user even presses the hotkey
    assert shown.kind == "notice" and "Secret Vault" in shown.summary
    time.sleep(QUIET_S)
    assert chat_requests(app) == before                        # nothing went to the worker
    vault.close()                                              # the vault is gone: the change is described
    window.focus()
    assert wait_until(lambda: chat_requests(app) == before + 1, 30)
    settle(app)


@pytest.mark.slow
def test_a_killed_worker_is_restarted_and_no_hotkey_press_is_lost(desktop):
    app, window = desktop
    settle(app)
    old_pid = app.supervisor.pid
    clear_overlay(app)
    results = []
    # results: what each press ended with ("thinking" is the answer still streaming in, not a result)
    app.overlay.on_shown = lambda content: (content is not None and content.kind != "thinking"
                                            and results.append(content))
    try:
        os.kill(old_pid, signal.SIGKILL)
        xdotool("key", "ctrl+alt+d")                           # two presses right after the kill:
        xdotool("key", "ctrl+alt+d")                           # each gets an answer or an error
        assert wait_until(lambda: len(results) >= 2, 120), results
    finally:
        app.overlay.on_shown = lambda content: None
    assert [r.kind in ("answer", "error") for r in results] == [True, True], results
    new_pid = wait_until(lambda: app.supervisor.pid not in (None, old_pid) and app.supervisor.pid, 120)
    assert new_pid and not psutil.pid_exists(old_pid)          # restarted, and the dead one reaped
    shown = press_describe_and_wait(app, timeout_s=120)       # the next describe succeeds on the new worker
    assert shown.kind == "answer" and "Revenue grew by twelve percent" in shown.summary
    assert chat_requests(app) >= 1


@pytest.mark.slow
def test_tray_pause_stops_requests_and_resume_restarts_them(desktop):
    app, window = desktop
    actions = app.tray_actions()
    before = settle(app)
    assert app.memory.turns() and app.screen_memory.last() is not None
    actions.toggle_pause()
    assert app.is_paused and app.tray.state == "paused"
    assert app.memory.turns() == [] and app.screen_memory.last() is None     # forgotten on pause
    window.set_line(4, "Paused change one")
    time.sleep(QUIET_S)
    shown = press_describe_and_wait(app, timeout_s=10)
    assert shown.kind == "notice" and "paused" in shown.summary.lower()
    clear_overlay(app)
    app.ask(STANDARD_QUESTION)                                  # a question about the screen: not while paused
    assert "paused" in app.overlay.wait_for(lambda s: s is not None, 10).summary
    time.sleep(QUIET_S)
    assert chat_requests(app) == before

    actions.toggle_pause()
    assert not app.is_paused
    assert wait_until(lambda: chat_requests(app) == before + 1, 30)
    assert settle(app) == before + 1
    assert app.tray.state == "idle"


@pytest.mark.slow
def test_tray_ask_routes_quick_standard_and_deep_questions(desktop, notification_server):
    app, window = desktop
    before = settle(app)
    clear_overlay(app)
    app.tray_actions().ask()                                    # tray "Ask…": a dialog to type into
    assert wait_until(lambda: xdotool("getwindowfocus", "getwindowname") == ASK_TITLE, 10)
    xdotool("type", "--delay", "5", QUICK_QUESTION)
    xdotool("key", "Return")                                    # quick: answered without the model
    shown = app.overlay.wait_for(lambda s: s is not None, 10)
    assert shown.kind == "answer" and ":" in shown.summary
    assert settle(app) == before

    clear_overlay(app)
    app.ask(STANDARD_QUESTION)                                  # standard: one model call
    shown = app.overlay.wait_for(lambda s: s is not None and s.kind == "answer", 60)   # streamed: after "thinking"
    assert shown is not None and "Costs" in shown.summary
    assert settle(app) == before + 1

    clear_overlay(app)
    seen: list[str] = []
    app.overlay.on_shown = lambda content: seen.append(content.kind if content else "hidden")
    try:
        app.ask(DEEP_QUESTION)
        shown = app.overlay.wait_for(lambda s: s is not None and s.kind == "answer", 60)
    finally:
        app.overlay.on_shown = lambda content: None
    assert shown is not None
    assert seen[:2] == ["thinking", "answer"]                  # deep: "thinking…" first, then the answer
    call = notification_server.wait_for_calls(1, 10)[-1]       # the desktop got a notification
    assert (call.app_name, call.title, call.body) == ("DeskEye", "DeskEye", shown.summary)
    assert settle(app) == before + 2


def test_open_settings_creates_the_file_and_starts_the_opener(desktop, tmp_path, monkeypatch):
    """xdg-open is not installed on the test machine: a script of that name records its argv instead."""
    app, _ = desktop
    record = tmp_path / "argv.txt"
    opener = tmp_path / "bin" / "xdg-open"
    opener.parent.mkdir()
    opener.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "{record}"\n')
    opener.chmod(0o755)
    monkeypatch.setenv("PATH", f"{opener.parent}{os.pathsep}{os.environ['PATH']}")
    assert not app.settings_path.exists()
    app.tray_actions().open_settings()
    assert app.settings_path.exists() and "[capture]" in app.settings_path.read_text()
    assert wait_until(lambda: record.exists() and record.read_text(), 5) == f"{app.settings_path}\n"


def test_quit_stops_every_thread_and_the_worker(desktop):
    app, _ = desktop
    worker_pid = app.supervisor.pid
    assert worker_pid
    app.tray_actions().quit()
    assert app.wait(30)
    assert not psutil.pid_exists(worker_pid)
    def non_daemon_threads():
        return [t.name for t in threading.enumerate() if not t.daemon and t not in THREADS_BEFORE_APP]
    assert wait_until(lambda: not non_daemon_threads(), 10), non_daemon_threads()
    assert not app.overlay.is_running
    assert app.memory.turns() == []
    assert not xdotool("search", "--name", WINDOW_TITLE)


@pytest.mark.slow
def test_deskeye_run_serves_a_hotkey_and_exits_cleanly_on_sigterm(xdisplay, tmp_path, open_window):
    """`deskeye run` as a user starts it: a real process with its own worker child."""
    open_window("Report - editor", REGION_GEOMETRY, lines=LINES)
    env = xdisplay.env(**{key: str(tmp_path / key.lower()) for key in
                          ("XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME")})
    proc = subprocess.Popen([sys.executable, "-m", "deskeye.cli", "run", "--engine", "ocr",
                             "--region", "560,240,800,600"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        ready = read_line_starting(proc, "deskeye: watching 800x600 at 560,240", 30)
        assert ready, "deskeye run did not report that it is watching"
        workers = wait_until(lambda: psutil.Process(proc.pid).children(recursive=True), 30)
        assert workers
        xdotool("key", "ctrl+alt+d")
        assert wait_until(lambda: xdotool("search", "--onlyvisible", "--name", WINDOW_TITLE), 90)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, output
    assert not [w for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]
    assert not xdotool("search", "--name", WINDOW_TITLE)


def test_frames_are_written_to_disk_only_when_debug_save_frames_dir_is_set(xdisplay, tmp_path):
    frames_dir = tmp_path / "frames"
    quiet = build_app(settings_from_dict({}, config_dir=tmp_path / "a"), use_tray=False, use_hotkeys=False)
    debug = build_app(settings_from_dict({"capture": {"debug_save_frames_dir": str(frames_dir)}},
                                         config_dir=tmp_path / "b"), use_tray=False, use_hotkeys=False)
    frame = quiet.grabber.grab()
    assert quiet.answering._png(frame) == frame.png()
    assert not frames_dir.exists() and not any(tmp_path.rglob("*.png"))
    png = debug.answering._png(frame)
    assert [p.read_bytes() for p in frames_dir.iterdir()] == [png]
    quiet.grabber.close_thread()
