"""Hotkeys (real pynput listener, keys sent by xdotool), the tray icon, and the app's job queue."""

from __future__ import annotations

import subprocess
import threading
import time

import pytest

from deskeye.errors import SettingsError
from deskeye.ui.hotkeys import Hotkeys
from deskeye.jobs import AUTO, DESCRIBE, HOTKEY, TRAY, Job, JobQueue
from deskeye.settings import HotkeySettings
from deskeye.ui.menu import menu_entries
from deskeye.ui.tray import BUSY, IDLE, PAUSED, WORKER_DOWN, Tray, TrayActions, draw_icon, opener_argv

pytestmark = [pytest.mark.desktop, pytest.mark.subprocess]


def test_every_hotkey_press_fires_once_and_stop_returns_at_once(xdisplay):
    describes, pauses = [], []
    hotkeys = Hotkeys(HotkeySettings(), on_describe=lambda: describes.append(1), on_pause=lambda: pauses.append(1))
    hotkeys.start()
    try:
        for _ in range(10):
            subprocess.run(["xdotool", "key", "ctrl+alt+d"], check=True, timeout=10)
        subprocess.run(["xdotool", "key", "ctrl+alt+p"], check=True, timeout=10)
        subprocess.run(["xdotool", "key", "d"], check=True, timeout=10)          # no modifiers: not a hotkey
        deadline = time.monotonic() + 5
        while (len(describes), len(pauses)) != (10, 1) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (len(describes), len(pauses)) == (10, 1)
    finally:
        started = time.monotonic()
        hotkeys.stop()
    assert time.monotonic() - started < 1.0 and not hotkeys.is_running
    assert not [t for t in threading.enumerate() if t.name == "deskeye-hotkeys" and t.is_alive()]


def test_a_hotkey_action_that_raises_does_not_end_the_listener(xdisplay):
    calls = []

    def broken():
        calls.append(1)
        raise RuntimeError("boom")

    hotkeys = Hotkeys(HotkeySettings(), on_describe=broken)
    hotkeys.start()
    try:
        for _ in range(2):
            subprocess.run(["xdotool", "key", "ctrl+alt+d"], check=True, timeout=10)
        deadline = time.monotonic() + 5
        while len(calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(calls) == 2 and hotkeys.is_running
    finally:
        hotkeys.stop()


def test_an_invalid_hotkey_is_a_settings_error_naming_the_key(xdisplay):
    with pytest.raises(SettingsError, match=r"hotkeys.describe = '<ctrl>\+<bogus>' is not a valid hotkey"):
        Hotkeys(HotkeySettings(describe="<ctrl>+<bogus>")).start()


def test_the_menu_reads_pause_or_resume_and_calls_the_plain_actions():
    paused, calls = [False], []
    actions = TrayActions(toggle_pause=lambda: calls.append("pause"), quit=lambda: calls.append("quit"),
                          is_paused=lambda: paused[0])
    assert [e.label for e in menu_entries(actions)] == ["Describe now", "Ask…", "Pause", "Open settings", "Quit"]
    paused[0] = True
    entries = {e.label: e for e in menu_entries(actions)}
    assert "Resume" in entries
    entries["Resume"].action()
    entries["Quit"].action()
    assert calls == ["pause", "quit"]


def test_without_a_tray_host_the_tray_says_so_once_and_stops_cleanly(xdisplay, caplog):
    """The session's bare Xvfb has no tray host: one warning, the icon thread keeps running, state updates
    go to the tray's own thread, and stop() ends it."""
    images = {state: draw_icon(state).tobytes() for state in (IDLE, BUSY, PAUSED, WORKER_DOWN)}
    assert len(set(images.values())) == 4
    tray = Tray(TrayActions())
    applied_on: list[str] = []
    apply_state = tray._apply_state

    def recording_apply_state():
        applied_on.append(threading.current_thread().name)
        return apply_state()

    tray._apply_state = recording_apply_state
    with caplog.at_level("WARNING", logger="deskeye.ui.tray"):
        tray.start()
        for state in (BUSY, IDLE, PAUSED, BUSY, IDLE):
            tray.set_state(state)                      # from this (the main) thread
        time.sleep(0.3)
    assert len(applied_on) >= 5 and set(applied_on) == {"deskeye-tray"}   # GTK is touched on its thread only
    try:
        warnings = [r.getMessage() for r in caplog.records if r.name == "deskeye.ui.tray"]
        assert len(warnings) == 1 and "No system tray is running" in warnings[0] and "Ctrl+Alt+A" in warnings[0]
        assert tray.backend == "statusicon" and tray.is_running and tray.state == IDLE
    finally:
        tray.stop()
    assert not tray.is_running


def test_opener_is_an_argv_list_without_a_shell(tmp_path):
    path = tmp_path / "my settings; rm -rf ~.toml"
    argv = opener_argv(path)
    assert argv[-1] == str(path) and len(argv) == 2


def test_user_jobs_go_first_in_order_and_one_automatic_describe_waits_at_most():
    queue = JobQueue()
    queue.put(Job(DESCRIBE, AUTO, question="frame 1"))
    queue.put(Job(DESCRIBE, HOTKEY, question="press 1"))
    queue.put(Job(DESCRIBE, AUTO, question="frame 2"))        # replaces frame 1
    queue.put(Job(DESCRIBE, HOTKEY, question="press 2"))
    queue.put(Job("ask", TRAY, question="question"))
    served = [queue.get(0.1).question for _ in range(4)]
    assert served == ["press 1", "press 2", "question", "frame 2"]
    assert queue.get(0.05) is None
    queue.put(Job(DESCRIBE, AUTO, question="frame 3"))
    queue.put_stop()
    with pytest.raises(StopIteration):
        queue.get(0.1)
