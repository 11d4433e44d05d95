"""`deskeye trigger describe|ask|pause|resume`: the running app's hotkey actions from a command, for the desktops whose
global hotkeys cannot see every key (Wayland), over a Unix socket in the user's runtime folder.

- A real `deskeye run` (OCR worker) on a test desktop (Xvfb, openbox, trayer), started over a stale socket a crashed
  app left. Its capture interval is longer than the module runs, so every describe the worker answers (counted at
  the worker's GET /metrics) comes from a trigger: describe puts the answer in the overlay (read back from the
  screen), pause stops describes and resume restarts them, ask opens the Ask box; a process of user `nobody` is
  refused (by the file modes, and by the app's own peer check when the modes are opened up); garbage, a 1 MB line
  and an unknown action each get an error reply, and the next trigger works.
- With no app: a clear error and a non-zero exit. The listener on its own (real sockets): a client that sends
  nothing is answered and dropped, a live socket is never taken over, the socket folder must be private, and stop
  ends the thread and removes the socket.
"""

from __future__ import annotations

import datetime
import os
import shutil
import socket
import stat
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

import pytest

from deskeye.doctor import check_hotkeys
from deskeye.see.session import Session
from deskeye.settings import HotkeySettings, Settings
from deskeye.ui.ask_box import ASK_TITLE
from deskeye.ui.hotkey_route import Route, hotkey_route
from deskeye.ui.portal_shortcuts import portal_trigger
from deskeye.ui.menu import MenuActions
from deskeye.ui.trigger import SOCKET_NAME, TriggerError, TriggerListener, send, socket_path
from tests.fixtures.deskeye_process import REPO_ROOT, start_deskeye
from tests.fixtures.desktop import start_desktop
from tests.fixtures.polling import wait_until
from tests.fixtures.tk_windows import open_test_window

REGION = "100,100,800,600"
WINDOW_GEOMETRY = "800x600+100+100"
LINES = ["Quarterly report draft", "Revenue grew by twelve percent", "Costs are under review"]
SETTINGS = ('[worker]\nengine = "ocr"\n[capture]\ninterval_s = 3600.0\n'      # no automatic describe in this module
            '[overlay]\nfade_after_s = 0.0\n[hooks]\ndry_run = true\n')
QUIET_S = 3.0
NOT_RUNNING = "DeskEye is not running; start it with `deskeye run`."


def run_trigger(env: dict[str, str], action: str, *, as_nobody: list[str] | None = None
                ) -> subprocess.CompletedProcess:
    """`deskeye trigger ACTION` as the user runs it (as_nobody: the command line that runs Python as `nobody`)."""
    argv = [*(as_nobody or [sys.executable]), "-m", "deskeye.cli", "trigger", action]
    return subprocess.run(argv, env={**env, "PYTHONPATH": python_path()}, capture_output=True, text=True, timeout=60)


def python_path() -> str:
    return os.pathsep.join([str(REPO_ROOT), sysconfig.get_paths()["purelib"]])


def exchange(path: Path, data: bytes) -> bytes:
    """Send `data` on the app's socket (from a thread: the app may stop reading) and return its whole reply."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(str(path))
        sender = threading.Thread(target=_send_quietly, args=(sock, data), daemon=True)
        sender.start()
        reply = b""
        while chunk := sock.recv(4096):
            reply += chunk
        sender.join(10)
    return reply


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
    except OSError:                  # the app answered and stopped reading: expected for a huge line
        pass


def leave_stale_socket(path: Path) -> None:
    """What a crashed app leaves: a bound socket file with nobody listening."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(path))


def read_in_background(proc: subprocess.Popen) -> list[str]:
    """The lines the process writes, as they come (and its pipe never fills while the tests run)."""
    lines: list[str] = []

    def read() -> None:
        for line in iter(proc.stdout.readline, ""):
            lines.append(line)
    threading.Thread(target=read, name="deskeye-output", daemon=True).start()
    return lines


def line_after(lines: list[str], prefix: str) -> str | None:
    return next((lines[i + 1] for i, line in enumerate(lines[:-1]) if line.startswith(prefix)), None)


def stays_at(app, count: int) -> bool:
    """Whether the worker has still answered `count` requests QUIET_S later: nothing more was sent. (No automatic
    describe comes in this module: only a trigger sends one.)"""
    time.sleep(QUIET_S)
    return app.chat_requests() == count


def on_the_desktop(test):
    """A test of the running app: slow, on the test desktop, with real processes."""
    return pytest.mark.slow(pytest.mark.desktop(pytest.mark.subprocess(test)))


def nobody_python() -> list[str] | None:
    """A command line running a Python that user `nobody` may execute with DeskEye importable (this one, or where it
    lives in a folder closed to others, as pyenv's under /root, the system's of the same version); None: none."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        return None
    setpriv = ["setpriv", "--reuid", "nobody", "--regid", "nogroup", "--clear-groups"]
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for python in dict.fromkeys([sys.executable, f"/usr/bin/{version}", f"/usr/local/bin/{version}"]):
        probe = subprocess.run([*setpriv, python, "-c", "import deskeye.cli"], capture_output=True, cwd="/",
                               env={**os.environ, "PYTHONPATH": python_path()}, timeout=60)
        if probe.returncode == 0:
            return [*setpriv, python]
    return None


# ------------------------------------------------------------------ a real `deskeye run`

@pytest.fixture(scope="module")
def running():
    """A test desktop, a window with known text in the region, and `deskeye run` started over a stale socket."""
    desktop = start_desktop(1600, 900, tray="trayer")
    window = app = None
    try:
        path = socket_path(desktop.env())
        leave_stale_socket(path)
        window = open_test_window(desktop.display, "Report - editor", WINDOW_GEOMETRY, lines=LINES)
        app = start_deskeye(desktop, "--region", REGION, settings=SETTINGS)
        output = read_in_background(app.proc)
        assert wait_until(lambda: any(line.startswith("deskeye: watching") for line in output), 120), output
        route = wait_until(lambda: line_after(output, "deskeye: watching"), 5) or ""
        assert wait_until(lambda: app.worker() is not None and app.chat_requests() == 0, 120), output
        yield desktop, window, app, route
    finally:
        if app is not None:
            app.stop()
        if window is not None:
            window.close()
        desktop.stop()


@on_the_desktop
def test_trigger_describe_describes_and_the_start_says_the_hotkey_route(running):
    desktop, window, app, route = running
    assert "Global hotkeys: describe Ctrl+Alt+D" in route and "deskeye trigger" in route, route
    assert app.overlay_rect() is None                          # nothing described yet: the stale socket was no app
    done = run_trigger(desktop.env(), "describe")
    assert done.returncode == 0 and "Describing the screen." in done.stdout, done.stderr
    assert wait_until(lambda: app.chat_requests() == 1, 60)
    assert wait_until(lambda: "Revenue grew by twelve percent" in app.overlay_text(), 60), app.overlay_text()
    assert stays_at(app, 1)


@on_the_desktop
def test_trigger_pause_stops_describes_and_resume_restarts_them(running):
    desktop, window, app, _route = running
    before = app.chat_requests()
    done = run_trigger(desktop.env(), "pause")
    assert done.returncode == 0 and "Paused." in done.stdout, done.stderr
    assert wait_until(lambda: "Paused" in app.overlay_text(), 30), app.overlay_text()
    window.set_line(1, "Revenue fell by half")
    done = run_trigger(desktop.env(), "describe")
    assert done.returncode == 0 and "paused" in done.stdout, done.stdout
    assert stays_at(app, before)                               # paused: the describe sent nothing

    assert run_trigger(desktop.env(), "resume").returncode == 0
    assert run_trigger(desktop.env(), "describe").returncode == 0
    assert wait_until(lambda: app.chat_requests() == before + 1, 60)
    assert wait_until(lambda: "Revenue fell by half" in app.overlay_text(), 60), app.overlay_text()
    assert stays_at(app, before + 1)


@on_the_desktop
def test_trigger_ask_opens_the_ask_box(running):
    desktop, _window, app, _route = running
    before = app.chat_requests()
    done = run_trigger(desktop.env(), "ask")
    assert done.returncode == 0, done.stderr
    assert wait_until(lambda: desktop.xdotool("getwindowfocus", "getwindowname") == ASK_TITLE, 20)
    desktop.xdotool("type", "--delay", "5", "what time is it")
    desktop.xdotool("key", "Return")                           # a quick question: answered without the model
    assert wait_until(lambda: not desktop.xdotool("search", "--onlyvisible", "--name", ASK_TITLE), 20)
    year = str(datetime.date.today().year)                     # the clock's answer: "It's 10:32 UTC on …, 2026."
    assert wait_until(lambda: year in app.overlay_text(), 30), app.overlay_text()
    assert stays_at(app, before)


@on_the_desktop
def test_another_user_is_refused_and_the_app_serves_on(running):
    desktop, _window, app, _route = running
    as_nobody = nobody_python()
    if as_nobody is None:
        pytest.skip("running a client as user nobody needs root, setpriv and a Python that nobody may run")
    env = {**desktop.env(), "HOME": "/nonexistent", "XDG_CONFIG_HOME": "/nonexistent"}
    before = app.chat_requests()
    done = run_trigger(env, "describe", as_nobody=as_nobody)   # the 0700 folders keep it out
    assert done.returncode == 1 and "permission denied" in done.stderr, done.stderr

    path = socket_path(desktop.env())
    opened = [desktop.home, path.parent.parent, path.parent, path]
    modes = {p: stat.S_IMODE(os.stat(p).st_mode) for p in opened}
    try:
        for p in opened:
            os.chmod(p, 0o777 if p == path else 0o711)        # as if the modes had been opened up
        done = run_trigger(env, "describe", as_nobody=as_nobody)
    finally:
        for p, mode in modes.items():
            os.chmod(p, mode)
    assert done.returncode == 1 and "Refused: this DeskEye belongs to another user." in done.stderr, done.stderr
    assert stays_at(app, before)                               # the refused trigger described nothing
    assert run_trigger(desktop.env(), "describe").returncode == 0
    assert wait_until(lambda: app.chat_requests() == before + 1, 60)
    assert stays_at(app, before + 1)


@on_the_desktop
def test_bad_input_on_the_socket_gets_an_error_reply_and_the_next_trigger_works(running):
    desktop, _window, app, _route = running
    path = socket_path(desktop.env())
    before = app.chat_requests()
    for data, reason in [(b"\xff\xfe\x00\x81garbage\n", "not a line of text"),
                         (b"describe" * 131072 + b"\n", "too long"),
                         (b"reboot\n", "Unknown request 'reboot'")]:
        reply = exchange(path, data)
        assert reply.startswith(b'{"ok": false') and reason.encode() in reply, reply
    done = run_trigger(desktop.env(), "describe")
    assert done.returncode == 0, done.stderr
    assert wait_until(lambda: app.chat_requests() == before + 1, 60)
    assert stays_at(app, before + 1)


# ------------------------------------------------------------------ without an app, and the listener alone

@pytest.mark.slow
@pytest.mark.subprocess
def test_trigger_without_a_running_app_says_how_to_start_it(tmp_path):
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    done = run_trigger(env, "describe")                        # no socket at all
    assert done.returncode == 1 and NOT_RUNNING in done.stderr, done.stderr
    leave_stale_socket(socket_path(env))                       # a socket a crashed app left
    done = run_trigger(env, "pause")
    assert done.returncode == 1 and NOT_RUNNING in done.stderr, done.stderr


def recording_actions() -> tuple[MenuActions, list[str]]:
    calls: list[str] = []
    return MenuActions(describe_now=lambda: calls.append("describe"), ask=lambda: calls.append("ask"),
                       toggle_pause=lambda: calls.append("toggle_pause")), calls


@pytest.mark.slow
def test_a_silent_client_is_answered_and_dropped_and_the_listener_serves_on(tmp_path):
    actions, calls = recording_actions()
    listener = TriggerListener(actions, tmp_path / "deskeye" / SOCKET_NAME)
    listener.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
            silent.settimeout(30)
            silent.connect(str(listener.path))
            assert b"No request within" in silent.recv(4096)
        assert send("describe", listener.path).is_ok and calls == ["describe"]
    finally:
        listener.stop()


def test_a_live_socket_is_kept_and_stop_ends_the_thread_and_removes_the_socket(tmp_path):
    first_actions, first_calls = recording_actions()
    first = TriggerListener(first_actions, tmp_path / "deskeye" / SOCKET_NAME)
    first.start()
    try:
        assert stat.S_IMODE(os.stat(first.path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(first.path.parent).st_mode) == 0o700
        second = TriggerListener(recording_actions()[0], first.path)
        with pytest.raises(TriggerError, match="Another DeskEye is running"):
            second.start()
        assert send("pause", first.path).is_ok and first_calls == ["toggle_pause"]
    finally:
        first.stop()
    assert not first.is_running and not first.path.parent.exists()      # the socket and its folder are gone
    with pytest.raises(TriggerError, match="DeskEye is not running"):
        send("describe", first.path)


def test_the_socket_folder_must_be_private(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))     # XDG_RUNTIME_DIR unset: a folder in the temp folder
    path = socket_path({})
    assert path == tmp_path / f"deskeye-{os.getuid()}" / SOCKET_NAME
    path.parent.mkdir(mode=0o755)                              # made by someone else, or opened up
    os.chmod(path.parent, 0o755)
    with pytest.raises(TriggerError, match="not a private folder"):
        TriggerListener(recording_actions()[0], path).start()
    assert not path.exists()


def test_the_hotkey_route_is_the_global_hotkeys_on_x11_and_the_trigger_command_on_wayland(monkeypatch):
    hotkeys = HotkeySettings()
    x11 = hotkey_route(hotkeys, session=Session.detect({"XDG_SESSION_TYPE": "x11", "DISPLAY": ":0"}, "linux"))
    assert x11.route == Route.GLOBAL_HOTKEYS and "Ctrl+Alt+D" in x11.message
    wayland = hotkey_route(hotkeys, session=Session.detect({"XDG_SESSION_TYPE": "wayland", "WAYLAND_DISPLAY":
                                                            "wayland-0", "DISPLAY": ":0"}, "linux"))
    assert wayland.route == Route.TRIGGER_COMMAND
    command = wayland.message.split("`")[1]                    # the command to bind, runnable as it is written
    assert command.endswith(" trigger describe") and Path(command.split()[0]).exists(), wayland.message
    assert "GNOME" in wayland.message and "KDE Plasma" in wayland.message
    monkeypatch.setenv("XDG_SESSION_TYPE", "wayland")
    assert check_hotkeys(Settings()).detail == wayland.message    # `deskeye doctor` says the same


def test_where_the_desktop_binds_global_shortcuts_the_route_names_the_keys_it_bound():
    wayland = Session.detect({"XDG_SESSION_TYPE": "wayland", "WAYLAND_DISPLAY": "wayland-0", "DISPLAY": ":0"},
                             "linux")
    route = hotkey_route(HotkeySettings(), session=wayland, hotkeys_running=True,
                         portal_bound={"describe": "Ctrl+Alt+D", "ask": "", "pause": "Meta+P"})
    assert route.route == Route.PORTAL_SHORTCUTS
    assert "describe Ctrl+Alt+D, ask no key yet, pause Meta+P" in route.message
    assert "System Settings › Shortcuts › deskeye" in route.message and "deskeye trigger" in route.message


@pytest.mark.parametrize("hotkey, trigger", [
    ("<ctrl>+<alt>+d", "CTRL+ALT+d"), ("<ctrl>++", "CTRL+plus"), ("<cmd>+<f1>", "LOGO+F1"),
    ("<shift_l>+<space>", "SHIFT+space"), ("<ctrl_l>+<ctrl_r>+<enter>", "CTRL+Return"), ("<ctrl>+<65>", ""),
])
def test_a_hotkey_setting_is_offered_to_the_portal_in_its_own_format(hotkey, trigger):
    """The XDG shortcuts format (modifiers, then an XKB keysym); a virtual key code has none: no preference."""
    assert portal_trigger(hotkey) == trigger
