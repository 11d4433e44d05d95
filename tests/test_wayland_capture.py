"""DeskEye on a real Wayland desktop never describes the black frame X11 capture gets there.

weston 10 headless with Xwayland (tests/fixtures/wayland.py) is what a GNOME, KDE Plasma or sway session looks like to
an X11 program: a real X11 window with text lies in the watched region all along, Xwayland shows it, and X11 capture
through Xwayland still returns black. Each of `deskeye doctor`, a one-shot `deskeye describe` and `deskeye run` is run
twice, as real processes:
- with the session's variables (XDG_SESSION_TYPE=wayland, WAYLAND_DISPLAY): the session decides, and DeskEye would
  see the screen through xdg-desktop-portal, which weston does not have (no session bus, no portal backend): the
  cause (no screen-capture portal answered) and the fix, before anything is grabbed (tests/test_gnome_wayland.py has
  the desktop where the portal answers);
- without them (only DISPLAY, as a systemd unit or a cleaned environment sees it): the pixel check refuses the black
  grab, and knows the X display is Xwayland.
The model server is a recording OpenAI-compatible stand-in (tests/fixtures/openai_recorder.py): what is checked is
what DeskEye sends it, which must be no screen frame at all.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.fixtures.deskeye_process import OVERLAY_TITLE, REPO_ROOT
from tests.fixtures.openai_recorder import RecordingServer
from tests.fixtures.polling import wait_until
from tests.fixtures.processes import stop_process
from tests.fixtures.tk_windows import open_test_window
from tests.fixtures.wayland import wayland_desktop  # noqa: F401 - a fixture

pytestmark = [pytest.mark.desktop, pytest.mark.subprocess, pytest.mark.slow]

CAUSE = "X11 capture through Xwayland is black on Wayland"
FIX = '"GNOME on Xorg" or "Plasma (X11)"'
NO_PORTAL = "No screen-capture portal answered on the D-Bus session bus"
PORTAL_FIX = "Install xdg-desktop-portal and your desktop's backend"
VARIABLES_FIX = "Start DeskEye inside the Wayland session, with its WAYLAND_DISPLAY and XDG_SESSION_TYPE=wayland set"
WAYLAND_SESSION = "This is a Wayland session (WAYLAND_DISPLAY=wayland-deskeye, Xwayland on DISPLAY="
BLACK_GRAB = "is uniformly black, so DeskEye does not describe it. This X display ({display}) is Xwayland"
INTERVAL_S = 0.5
NUM_TICKS = 8                  # `deskeye run` is watched this many capture intervals


@pytest.fixture
def recorder():
    with RecordingServer() as server:
        yield server


@pytest.fixture
def session(wayland_desktop, tmp_path, recorder):  # noqa: F811 - the fixture imported above
    """The Wayland desktop with a white X11 window of text over the watched region, and a settings file that
    points DeskEye at the recording model server."""
    window = open_test_window(wayland_desktop.xwayland, "Report - editor", "1280x800+0+0",
                              lines=["Quarterly report", "Revenue up 12 percent"])
    settings = tmp_path / "settings.toml"
    settings.write_text(f'[worker]\nurl = "{recorder.url}"\napi_key = "test"\nremote_model = "recorder"\n'
                        f'ocr_first = false\n[capture]\ninterval_s = {INTERVAL_S}\n[overlay]\nfade_after_s = 0.0\n'
                        '[hooks]\ndry_run = true\n', encoding="utf-8")
    yield wayland_desktop, settings
    window.close()


def deskeye_env(desktop, tmp_path, *, session_variables: bool) -> dict[str, str]:
    dirs = {}
    for name in ("XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME"):
        (tmp_path / name.lower()).mkdir(exist_ok=True)
        dirs[name] = str(tmp_path / name.lower())
    env = desktop.env(session_variables=session_variables, PYTHONPATH=str(REPO_ROOT), NO_AT_BRIDGE="1",
                      HF_HUB_OFFLINE="1", **dirs)
    env.pop("DBUS_SESSION_BUS_ADDRESS", None)     # weston's session has no bus (never the developer's own)
    return env


def deskeye(session, tmp_path, *args: str, session_variables: bool) -> subprocess.CompletedProcess:
    desktop, settings = session
    return subprocess.run([sys.executable, "-m", "deskeye.cli", "--settings", str(settings), *args],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
                          env=deskeye_env(desktop, tmp_path, session_variables=session_variables))


def test_doctor_fails_the_capture_line_naming_the_cause_and_the_fix(session, tmp_path):
    desktop = session[0]
    proc = deskeye(session, tmp_path, "doctor", session_variables=True)
    lines = {line.split()[1]: line for line in proc.stdout.splitlines()}
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert lines["display"].startswith("OK") and "Wayland session" in lines["display"], proc.stdout
    assert lines["capture"].startswith("FAIL"), proc.stdout
    assert WAYLAND_SESSION in lines["capture"] and CAUSE in lines["capture"] and FIX in lines["capture"]
    assert NO_PORTAL in lines["capture"] and PORTAL_FIX in lines["capture"]

    proc = deskeye(session, tmp_path, "doctor", session_variables=False)       # the pixels are checked
    lines = {line.split()[1]: line for line in proc.stdout.splitlines()}
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert lines["capture"].startswith("FAIL"), proc.stdout
    assert BLACK_GRAB.format(display=desktop.xwayland.name) in lines["capture"] and FIX in lines["capture"]
    assert VARIABLES_FIX in lines["capture"]
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("session_variables, message", [(True, WAYLAND_SESSION), (False, BLACK_GRAB)])
def test_describe_exits_with_the_cause_and_the_fix_and_sends_nothing(session, tmp_path, recorder,
                                                                    session_variables, message):
    proc = deskeye(session, tmp_path, "describe", "--json", session_variables=session_variables)
    assert proc.returncode == 1 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.startswith("deskeye: ")
    assert message.format(display=session[0].xwayland.name) in proc.stderr, proc.stderr
    assert CAUSE in proc.stderr and FIX in proc.stderr
    if session_variables:
        assert NO_PORTAL in proc.stderr and PORTAL_FIX in proc.stderr
    assert "Traceback" not in proc.stderr
    assert recorder.requests == []


def start_run(session, tmp_path, *, session_variables: bool) -> subprocess.Popen:
    desktop, settings = session
    return subprocess.Popen([sys.executable, "-m", "deskeye.cli", "--settings", str(settings), "run"],
                            env=deskeye_env(desktop, tmp_path, session_variables=session_variables), cwd=REPO_ROOT,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_run_in_the_wayland_session_says_why_and_exits_without_sending(session, tmp_path, recorder):
    proc = start_run(session, tmp_path, session_variables=True)
    try:
        output, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        stop_process(proc, timeout_s=30)
        pytest.fail(f"deskeye run kept running on Wayland; it sent {len(recorder.requests)} requests")
    assert proc.returncode == 1, output
    assert f"deskeye: {WAYLAND_SESSION}" in output and CAUSE in output and FIX in output, output
    assert NO_PORTAL in output and PORTAL_FIX in output, output
    assert "Traceback" not in output
    assert recorder.requests == []


def test_run_without_the_session_variables_refuses_every_black_grab_and_says_so_once(session, tmp_path, recorder):
    desktop = session[0]
    proc = start_run(session, tmp_path, session_variables=False)
    try:
        shown = wait_until(lambda: overlay_shown(desktop) or proc.poll() is not None or bool(recorder.requests), 60)
        assert shown and proc.poll() is None, "the overlay never showed"
        time.sleep(NUM_TICKS * INTERVAL_S)            # more ticks: each grab is black again, and refused again
        assert proc.poll() is None, "deskeye run stopped"
    finally:
        stop_process(proc, timeout_s=30)
    output = proc.stdout.read()
    said = [line for line in output.splitlines() if "capture failed" in line]
    assert len(said) == 1, output
    assert BLACK_GRAB.format(display=desktop.xwayland.name) in said[0] and FIX in said[0]
    assert recorder.requests == [], f"a black frame went to the model server:\n{output}"


def overlay_shown(desktop) -> bool:
    done = subprocess.run(["xdotool", "search", "--onlyvisible", "--name", OVERLAY_TITLE], capture_output=True,
                          text=True, timeout=10, env=desktop.env(session_variables=False))
    return bool(done.stdout.strip())
