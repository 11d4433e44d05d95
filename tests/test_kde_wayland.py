"""DeskEye on a KDE Plasma Wayland desktop: a global shortcut describes while a native Wayland window has focus, and
title exclusions hold on native windows.

A real headless kwin_wayland 5.27 session with PipeWire and the KDE portal (tests/fixtures/kde.py), one per file,
shows a real GTK program as a native Wayland window, full screen and focused, with a known line of text. pynput never
hears a key pressed there (it hears X11 windows' keys only): the real `deskeye run` asks the desktop's GlobalShortcuts
portal for its shortcuts, KDE registers them (kglobalaccel: System Settings › Shortcuts › deskeye), and a press of
the describe shortcut sends the native window's pixels to a recording model server. `deskeye doctor` names the same
route. KWin tells DeskEye every window (a KWin script, deskeye/see/kwin_windows.py): a native window titled as a
private browser window, in Chinese or English, is refused by the privacy decision, and a real `deskeye describe` sends
nothing while it is on screen (and does once it is gone).

DeskEye watches through the portal's Screenshot here (`capture.portal = "screenshot"`): KDE's ScreenCast would first
show its chooser (no consent can be seeded for it here), and KWin's virtual output streams no frames.
"""

from __future__ import annotations

import stat
import subprocess
import sys

import pytest

from deskeye.see.portal_token import WINDOW_TOKEN_FILE
from deskeye.see.privacy import WHERE_ACTIVE, check_privacy
from deskeye.see.window_list import SessionWindows, WindowSource
from deskeye.see.x11_windows import OwnWindows
from deskeye.settings import Settings

from tests.fixtures.deskeye_process import REPO_ROOT
from tests.fixtures.gnome import open_native_window
from tests.fixtures.kde import WIDTH, kde_desktop  # noqa: F401 - a fixture
from tests.fixtures.openai_recorder import RecordingServer
from tests.fixtures.polling import wait_until
from tests.fixtures.processes import stop_process
from tests.test_wayland_own_windows import (NATIVE_TEXT, NATIVE_WORDS, app_env, on_a_desktop, read_text,
                                            sent_frames, the_ask_box_over_the_overlay, with_output)
from tests.test_wayland_privacy import PRIVATE_TITLES, TITLES_UNKNOWN

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
    assert TITLES_UNKNOWN not in output and "Traceback" not in output, output       # KWin tells its windows


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
    assert lines["privacy"].startswith("OK") and "from KWin" in lines["privacy"], proc.stdout


# ------------------------------------------------------------------ DeskEye's own windows

@on_a_desktop
def test_on_kde_the_overlay_is_on_top_and_never_described(kde_desktop, tmp_path):  # noqa: F811
    """The overlay (an Xwayland window) is drawn above the full-screen native window, and painted over in every
    frame sent; the Ask box shows above it."""
    from PIL import Image

    env = kde_desktop.env(**app_env(tmp_path))
    window = open_native_window(kde_desktop, "Native GTK window", NATIVE_TEXT)
    shot = tmp_path / "screen.png"

    def screenshot():
        kde_desktop.screenshot(shot)
        with Image.open(shot) as image:
            return image.convert("RGB")

    def trigger(action: str):
        return subprocess.run([sys.executable, "-m", "deskeye.cli", "trigger", action], capture_output=True,
                              text=True, timeout=30, cwd=REPO_ROOT, env=env)

    def start(argv):
        return subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    try:
        asking = the_ask_box_over_the_overlay(start, lambda proc: stop_process(proc, timeout_s=30), screenshot,
                                              trigger, tmp_path, 'portal = "screenshot"\n')
    finally:
        stop_process(window, timeout_s=5)
    assert asking, "the Ask box did not show above the overlay"


# ------------------------------------------------------------------ watching one window

SHARED_TEXT, SHARED_WORDS = "SHARED WINDOW 5309", ("shared", "5309")
COVER_TEXT = "COVERING WINDOW 1122"


def describe_one_window(desktop, tmp_path):
    """`deskeye describe --json` with capture.source = "window" while "Shared notes" is covered by another window:
    the desktop's dialog offers windows, and the user's pick of "Shared notes" is played with a seeded restore token
    for it. Returns the finished process, the frames the model server got and the token's file."""
    env = desktop.env(**app_env(tmp_path))
    shared = open_native_window(desktop, "Shared notes", SHARED_TEXT)
    cover = open_native_window(desktop, "Covering window", COVER_TEXT)          # above it, focused
    try:
        token = tmp_path / "xdg_state_home" / "deskeye" / WINDOW_TOKEN_FILE
        token.parent.mkdir(mode=0o700, parents=True)
        token.write_text(desktop.consent_to_window_screencast(desktop.window_id("Shared notes")), encoding="ascii")
        token.chmod(0o600)
        with RecordingServer() as recorder:
            settings = tmp_path / "settings.toml"
            settings.write_text(kde_settings(recorder).replace('portal = "screenshot"', 'source = "window"'),
                                encoding="utf-8")
            proc = subprocess.run([sys.executable, "-m", "deskeye.cli", "--settings", str(settings), "describe",
                                   "--json"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
            return proc, sent_frames(recorder), token
    finally:
        stop_process(cover, timeout_s=5)
        stop_process(shared, timeout_s=5)


@on_a_desktop
def test_watching_one_window_sees_it_under_another_and_nothing_else(kde_desktop, tmp_path):  # noqa: F811
    """capture.source = "window": DeskEye reads the picked window's own pixels through the ScreenCast portal, even
    with another window full screen above it, and sends nothing of the covering window."""
    proc, frames, token = describe_one_window(kde_desktop, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert len(frames) == 1 and frames[0].size == (WIDTH, 800), [f.size for f in frames]    # the whole window
    text = read_text(frames[0])
    assert all(word in text for word in SHARED_WORDS) and "covering" not in text, text
    assert "asks once which window" not in proc.stderr, proc.stderr                # the seeded pick was restored
    assert token.read_text(encoding="ascii") and stat.S_IMODE(token.stat().st_mode) == 0o600


@on_a_desktop
def test_a_pipewire_without_its_session_manager_is_named_not_the_users_sharing(kde_desktop, tmp_path):  # noqa: F811
    """wireplumber not running (it crashed, or the login never started it): PipeWire links no stream to DeskEye's
    reader, so no frame ever comes. DeskEye says that PipeWire did not connect it and how to check the session
    manager; it sends nothing and does not blame the user's sharing indicator."""
    with kde_desktop.without_session_manager():
        proc, frames, _token = describe_one_window(kde_desktop, tmp_path)
    assert proc.returncode != 0 and not frames, (proc.returncode, len(frames))
    assert "PipeWire did not connect DeskEye" in proc.stderr, proc.stderr
    assert "systemctl --user status wireplumber" in proc.stderr, proc.stderr
    assert "sharing indicator" not in proc.stderr, proc.stderr


# ------------------------------------------------------------------ privacy: KWin tells every window

def decide(desktop):
    """The privacy decision as the app and the one-shot commands make it in this session."""
    windows = SessionWindows(OwnWindows(display_name=desktop.display), environ=desktop.env())
    assert windows.source == WindowSource.KWIN
    seen = windows.read()
    return check_privacy(Settings().excluded_titles, region=None, windows=seen.windows, active=seen.active)


@on_a_desktop
@pytest.mark.parametrize("lang", ["zh", "en"])
def test_on_kde_a_private_native_window_is_refused_naming_it(kde_desktop, lang):  # noqa: F811
    window = open_native_window(kde_desktop, PRIVATE_TITLES[lang], "Private page")
    try:
        verdict = decide(kde_desktop)
    finally:
        stop_process(window, timeout_s=5)
    assert verdict.is_excluded, "the native private window is not seen"
    assert PRIVATE_TITLES[lang] in verdict.reason and WHERE_ACTIVE in verdict.reason, verdict.reason
    window = open_native_window(kde_desktop, "Notes", "Shopping list")
    try:
        assert not decide(kde_desktop).is_excluded          # a normal native window alone: allowed
    finally:
        stop_process(window, timeout_s=5)


@on_a_desktop
def test_describe_on_kde_never_sends_an_excluded_window(kde_desktop, tmp_path):  # noqa: F811
    env = kde_desktop.env(**app_env(tmp_path))
    with RecordingServer() as recorder:
        settings = tmp_path / "settings.toml"
        settings.write_text(kde_settings(recorder), encoding="utf-8")

        def describe() -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "deskeye.cli", "--settings", str(settings), "describe",
                                   "--json"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
        window = open_native_window(kde_desktop, PRIVATE_TITLES["zh"], "Private page")
        try:
            refused = describe()
        finally:
            stop_process(window, timeout_s=5)
        assert refused.returncode == 3 and PRIVATE_TITLES["zh"] in refused.stderr, refused.stderr
        assert recorder.requests == []
        window = open_native_window(kde_desktop, "Notes", NATIVE_TEXT)
        try:
            allowed = describe()
        finally:
            stop_process(window, timeout_s=5)
        assert allowed.returncode == 0, allowed.stderr
        assert len(recorder.requests) == 1 and TITLES_UNKNOWN not in allowed.stderr


# ------------------------------------------------------------------ an untrusted answer (no desktop needed)

class StandInKWin:
    """Owns org.kde.KWin on a test bus and answers its Scripting calls; on `start` it sends `answer` to DeskEye's
    object from its own connection (`from_kwin`) or from another program's (a forged report), or nothing."""

    SCRIPTING_XML = """<node><interface name="org.kde.kwin.Scripting">
      <method name="loadScript"><arg type="s" direction="in"/><arg type="s" direction="in"/>
        <arg type="i" direction="out"/></method>
      <method name="start"/>
      <method name="unloadScript"><arg type="s" direction="in"/><arg type="b" direction="out"/></method>
    </interface></node>"""

    def __init__(self, address: str, answer: str | None, *, from_kwin: bool = True):
        import threading

        from gi.repository import Gio, GLib
        self.answer, self.from_kwin, self.scripts = answer, from_kwin, []
        flags = Gio.DBusConnectionFlags.AUTHENTICATION_CLIENT | Gio.DBusConnectionFlags.MESSAGE_BUS_CONNECTION
        self.conn = Gio.DBusConnection.new_for_address_sync(address, flags, None, None)
        self.other = Gio.DBusConnection.new_for_address_sync(address, flags, None, None)
        self.context = GLib.MainContext.new()
        self.context.push_thread_default()
        try:
            interface = Gio.DBusNodeInfo.new_for_xml(self.SCRIPTING_XML).interfaces[0]
            self.conn.register_object("/Scripting", interface, self._on_call, None, None)
        finally:
            self.context.pop_thread_default()
        owned = self.conn.call_sync("org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus",
                                    "RequestName", GLib.Variant("(su)", ("org.kde.KWin", 4)), None, 0, 5000, None)
        assert owned.unpack() == (1,)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stop.is_set():
            self.context.iteration(False)
            self.stop.wait(0.005)

    def _on_call(self, _conn, sender, _path, _interface, method, params, invocation):
        from gi.repository import GLib
        if method == "loadScript":
            self.scripts.append(params.unpack()[0])
            invocation.return_value(GLib.Variant("(i)", (len(self.scripts),)))
        elif method == "unloadScript":
            invocation.return_value(GLib.Variant("(b)", (True,)))
        else:
            invocation.return_value(None)
            if self.answer is not None:
                via = self.conn if self.from_kwin else self.other
                via.call(sender, "/org/deskeye/KWinWindows", "org.deskeye.KWinWindows", "Report",
                         GLib.Variant("(s)", (self.answer,)), None, 0, 5000, None, None, None)

    def close(self):
        self.stop.set()
        self.thread.join(5)
        self.conn.close_sync(None)
        self.other.close_sync(None)


def read_from_stand_in(dbus_session, answer, **options):
    from deskeye.see.kwin_windows import KWinWindows
    kwin = StandInKWin(dbus_session, answer, **options)
    windows = KWinWindows({"DBUS_SESSION_BUS_ADDRESS": dbus_session, "XDG_CURRENT_DESKTOP": "KDE"})
    try:
        return windows.read()
    finally:
        windows.close()
        kwin.close()


WINDOW = {"id": "{0f}", "x11": 0, "caption": "Notes", "app": ["notes", "Notes", ""], "pid": 42, "x": 0, "y": 0,
          "width": 800, "height": 600, "active": True, "visible": True}


def test_kwins_own_report_is_read_field_by_field(dbus_session):
    import json
    windows = read_from_stand_in(dbus_session, json.dumps([WINDOW, {**WINDOW, "x": "left"}, "junk",
                                                           {**WINDOW, "caption": 7, "pid": True, "x11": 4242}]))
    assert [(w.title, w.pid, w.x11_id, w.focused) for w in windows] == [("Notes", 42, None, True), ("", None, 4242,
                                                                                                     True)]
    assert windows[0].window_id != windows[1].window_id and windows[0].rect.width == 800


def test_a_report_from_another_program_than_kwin_is_ignored(dbus_session):
    """Anyone on the bus can call DeskEye's object: a forged, empty window list would hide a private window."""
    import json

    from deskeye.see.kwin_windows import KWinError
    with pytest.raises(KWinError, match="did not list its windows within"):
        read_from_stand_in(dbus_session, json.dumps([]), from_kwin=False)


@pytest.mark.parametrize("answer, problem", [
    (None, "did not list its windows within"), ("not json", "not JSON"), ('{"a": 1}', "not a JSON list"),
    ("[" * 100_000 + "]" * 100_000, "not JSON"), ("[]" + " " * (9 << 20), "at most"),
])
def test_a_kwin_that_answers_nothing_or_garbage_is_an_error_not_an_empty_desktop(dbus_session, answer, problem):
    from deskeye.see.kwin_windows import KWinError
    with pytest.raises(KWinError, match=problem):
        read_from_stand_in(dbus_session, answer)


def test_where_kwin_is_not_on_the_bus_privacy_looks_at_nothing(dbus_session):
    from deskeye.errors import DeskEyeError
    windows = SessionWindows(OwnWindows(), environ={"DBUS_SESSION_BUS_ADDRESS": dbus_session, "XDG_SESSION_TYPE":
                                                    "wayland", "WAYLAND_DISPLAY": "wayland-9", "XDG_CURRENT_DESKTOP":
                                                    "KDE"})
    with pytest.raises(DeskEyeError, match="DeskEye is not looking"):
        windows.read()
