"""DeskEye on a KDE Plasma Wayland desktop: a global shortcut describes while a native Wayland window has focus.

A real headless kwin_wayland 5.27 session with PipeWire and the KDE portal (tests/fixtures/kde.py), one per file,
shows a real GTK program as a native Wayland window, full screen and focused, with a known line of text. pynput never
hears a key pressed there (it hears X11 windows' keys only): the real `deskeye run` asks the desktop's GlobalShortcuts
portal for its shortcuts, KDE registers them (kglobalaccel: System Settings › Shortcuts › deskeye), and a press of
the describe shortcut sends the native window's pixels to a recording model server. `deskeye doctor` names the same
route.

DeskEye watches through the portal's Screenshot here (`capture.portal = "screenshot"`): KDE's ScreenCast would first
show its chooser (no consent can be seeded for it here), and KWin's virtual output streams no frames.
"""

from __future__ import annotations

import subprocess
import sys

from tests.fixtures.deskeye_process import REPO_ROOT
from tests.fixtures.gnome import open_native_window
from tests.fixtures.kde import kde_desktop  # noqa: F401 - a fixture
from tests.fixtures.openai_recorder import RecordingServer
from tests.fixtures.polling import wait_until
from tests.fixtures.processes import stop_process
from tests.test_wayland_own_windows import (NATIVE_TEXT, NATIVE_WORDS, app_env, on_a_desktop, read_text,
                                            sent_frames, with_output)

START_TIMEOUT_S = 120.0
QUIET_S = 4.0                  # no describe for this long: the screen is static, nothing else asks for one
SHORTCUT_TIMEOUT_S = 60.0
COMPONENT = "deskeye"          # the shortcuts' group in KDE (the portal session's token)


def kde_settings(recorder) -> str:
    return (f'[worker]\nurl = "{recorder.url}"\napi_key = "test"\nremote_model = "recorder"\nocr_first = false\n'
            'startup_timeout_s = 90.0\nrequest_timeout_s = 90.0\n'
            '[capture]\ninterval_s = 0.5\nportal = "screenshot"\n[overlay]\nfade_after_s = 0.0\n'
            '[hooks]\ndry_run = true\n')


def quiet(recorder) -> bool:
    """True once no frame was sent for QUIET_S."""
    before = len(sent_frames(recorder))
    return not wait_until(lambda: len(sent_frames(recorder)) > before, QUIET_S, interval_s=0.2)


@on_a_desktop
def test_on_kde_the_describe_shortcut_describes_while_a_native_window_has_focus(kde_desktop, tmp_path):  # noqa: F811
    env = kde_desktop.env(**app_env(tmp_path))
    window = open_native_window(kde_desktop, "Native GTK window", NATIVE_TEXT)
    try:
        with RecordingServer() as recorder:
            settings = tmp_path / "settings.toml"
            settings.write_text(kde_settings(recorder), encoding="utf-8")
            proc = subprocess.Popen([sys.executable, "-m", "deskeye.cli", "--settings", str(settings), "run"],
                                    cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
            try:
                assert wait_until(lambda: sent_frames(recorder), START_TIMEOUT_S), "no frame was sent"
                assert wait_until(lambda: f"/component/{COMPONENT}" in kde_desktop.shortcut_components(), 30), \
                    f"DeskEye's shortcuts never reached KDE: {kde_desktop.shortcut_components()}"
                assert wait_until(lambda: quiet(recorder), 60, interval_s=0), "the app kept describing"
                before = len(sent_frames(recorder))
                kde_desktop.press_shortcut(COMPONENT, "describe")
                assert wait_until(lambda: len(sent_frames(recorder)) > before, SHORTCUT_TIMEOUT_S), \
                    "the describe shortcut sent nothing"
                assert proc.poll() is None, "deskeye run stopped"
            except AssertionError as exc:
                stop_process(proc, timeout_s=30)
                raise AssertionError(with_output(exc, proc)) from None
            finally:
                stop_process(proc, timeout_s=30)
            output = proc.stdout.read()
            frames = sent_frames(recorder)
    finally:
        stop_process(window, timeout_s=5)
    text = read_text(frames[before])
    assert all(word in text for word in NATIVE_WORDS), text                  # the native window, seen and sent
    assert "Global shortcuts from your desktop: describe Ctrl+Alt+D" in output, output
    assert "Traceback" not in output, output


@on_a_desktop
def test_doctor_on_kde_names_the_desktops_shortcuts_and_checks_the_screenshot(kde_desktop, tmp_path):  # noqa: F811
    env = kde_desktop.env(**app_env(tmp_path))
    window = open_native_window(kde_desktop, "Native GTK window", NATIVE_TEXT)
    try:
        with RecordingServer() as recorder:
            settings = tmp_path / "settings.toml"
            settings.write_text(kde_settings(recorder), encoding="utf-8")
            proc = subprocess.run([sys.executable, "-m", "deskeye.cli", "--settings", str(settings), "doctor"],
                                  cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    finally:
        stop_process(window, timeout_s=5)
    lines = {line.split()[1]: line for line in proc.stdout.splitlines() if len(line.split()) > 1}
    assert lines["capture"].startswith("OK") and "Screenshot" in lines["capture"], proc.stdout + proc.stderr
    assert "pixels checked: not black" in lines["capture"], proc.stdout
    assert "Global shortcuts from your desktop: describe Ctrl+Alt+D" in lines["hotkeys"], proc.stdout
