"""DeskEye sees a GNOME Wayland screen through xdg-desktop-portal, where X11 capture gets only black.

A real headless gnome-shell 43 session with PipeWire and the GNOME portal (tests/fixtures/gnome.py), one per file,
shows a real GTK program as a native Wayland window, full screen, with a known line of text. DeskEye runs as a real
process of that session (inside its namespaces, as the desktop's programs are: the portal reads who is calling from
/proc) with the built-in OCR engine, and must read that line: through the portal's ScreenCast (a PipeWire stream),
with the restore token of the user's one-time consent kept 0600 in its state folder and used again by the next run.
The test plays the user's consent the way FIELD_NOTES records (a seeded permission-store entry), and the portal's
Screenshot is checked on its own (the fallback for desktops whose stream sends nothing). `deskeye run` sends the
native window's pixels to a recording model server. Without a token DeskEye says the desktop will ask, and a SIGTERM
ends its wait for the answer. The last tests, with no desktop, check what DeskEye takes from the portal's replies (a
screenshot's URI, the restore token) before it uses it.
"""

from __future__ import annotations

import base64
import io
import json
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from deskeye.errors import CaptureError
from tests.fixtures.deskeye_process import REPO_ROOT
from tests.fixtures.gnome import gnome_desktop, open_native_window, stop_inside  # noqa: F401 - a fixture
from tests.fixtures.openai_recorder import RecordingServer
from tests.fixtures.polling import wait_until
from tests.fixtures.processes import stop_process



def on_gnome(test):
    """A test on the GNOME desktop: slow, with a desktop and subprocesses (the file's last tests need neither)."""
    for mark in (pytest.mark.desktop, pytest.mark.subprocess, pytest.mark.slow):
        test = mark(test)
    return test


WINDOW_TEXT = "NATIVE WAYLAND WINDOW 4217"
WORDS = ("native", "wayland", "window", "4217")
BACKEND = "xdg-desktop-portal ScreenCast (GNOME)"
TOKEN_FILE = "deskeye/screencast-restore-token"
CONSENT = "GNOME asks once whether DeskEye may see the screen"
STOP_S = 5.0                      # a SIGTERM ends `deskeye describe` within this, whatever it waits for
REGION = "0,250,1280,300"         # the window's line of text, in the middle of the 1280x800 monitor


@pytest.fixture(scope="module")
def native_window(gnome_desktop):  # noqa: F811 - the fixture imported above
    proc = open_native_window(gnome_desktop, "Native GTK window", WINDOW_TEXT)
    yield proc
    stop_process(proc, timeout_s=5)


@pytest.fixture
def home(tmp_path):
    """DeskEye's own folders for one test (its state folder holds the restore token), and a settings file."""
    dirs = {}
    for name in ("XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME"):
        (tmp_path / name.lower()).mkdir(mode=0o700)
        dirs[name] = str(tmp_path / name.lower())
    settings = tmp_path / "settings.toml"
    settings.write_text("[worker]\nstartup_timeout_s = 90.0\nrequest_timeout_s = 90.0\n", encoding="utf-8")
    return dirs, settings


def consent(desktop, tmp_path) -> str:
    """The user's one-time yes: the portal's token for it, where DeskEye keeps the one the portal gave it."""
    token = desktop.consent_to_screencast()
    path = tmp_path / "xdg_state_home" / TOKEN_FILE
    path.parent.mkdir(mode=0o700, exist_ok=True)
    path.write_text(token, encoding="ascii")
    path.chmod(0o600)
    return token


def deskeye_env(desktop, home) -> dict[str, str]:
    return desktop.env(PYTHONPATH=str(REPO_ROOT), HF_HUB_OFFLINE="1", NO_AT_BRIDGE="1", **home[0])


def deskeye(desktop, home, *args: str, timeout_s: float = 180) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "deskeye.cli", "--settings", str(home[1]), *args]
    return desktop.run(argv, timeout_s, cwd=REPO_ROOT, env=deskeye_env(desktop, home))


def read_token(tmp_path) -> tuple[str, int, int]:
    """The saved token, its file's mode and inode (DeskEye replaces the file whole: a new inode)."""
    path = tmp_path / "xdg_state_home" / TOKEN_FILE
    info = path.stat()
    return path.read_text(encoding="ascii"), stat.S_IMODE(info.st_mode), info.st_ino


@on_gnome
def test_describe_reads_the_native_window_through_the_screencast_portal(gnome_desktop, native_window, home,
                                                                       tmp_path):
    seeded = consent(gnome_desktop, tmp_path)
    seeded_inode = read_token(tmp_path)[2]
    proc = deskeye(gnome_desktop, home, "describe", "--engine", "ocr", "--json", "--region", REGION)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)["summary"].lower()
    assert all(word in summary for word in WORDS), (summary, proc.stderr)
    assert CONSENT not in proc.stderr                 # the saved token skipped the dialog
    assert "Traceback" not in proc.stderr

    token, mode, inode = read_token(tmp_path)         # the token Start answered, written anew (0600)
    assert token and mode == 0o600 and inode != seeded_inode, (token, seeded, oct(mode))
    again = deskeye(gnome_desktop, home, "describe", "--engine", "ocr", "--json", "--region", REGION)
    assert again.returncode == 0, again.stderr        # the saved token worked: no dialog, no wait
    assert all(word in json.loads(again.stdout)["summary"].lower() for word in WORDS)
    assert CONSENT not in again.stderr
    assert read_token(tmp_path)[1] == 0o600


@on_gnome
def test_doctor_names_the_portal_backend_and_checks_the_pixels(gnome_desktop, native_window, home, tmp_path):
    consent(gnome_desktop, tmp_path)
    proc = deskeye(gnome_desktop, home, "doctor")
    lines = {line.split()[1]: line for line in proc.stdout.splitlines() if len(line.split()) > 1}
    assert lines["capture"].startswith("OK"), proc.stdout + proc.stderr
    assert f"with {BACKEND}" in lines["capture"] and "pixels checked: not black" in lines["capture"]
    assert "Wayland session" in lines["display"], proc.stdout


SCREENSHOT_SCRIPT = """
import sys
from deskeye.see.geometry import Rect
from deskeye.see.portal_screenshot import PortalScreenshotBackend
from deskeye.see.session import Session
backend = PortalScreenshotBackend(Session.detect())
try:
    print(backend.name, backend.monitors()[1])
    image = backend.grab(Rect(0, 300, 1280, 200))
    image.save(sys.argv[1])
finally:
    backend.close()
"""


@on_gnome
def test_the_screenshot_portal_backend_sees_the_native_window(gnome_desktop, native_window, home, tmp_path):
    """The fallback where a stream sends nothing (wlroots without a GPU), checked on GNOME's Screenshot."""
    gnome_desktop.allow_screenshots()                 # the user's yes, as the permission store keeps it
    out = tmp_path / "strip.png"
    proc = gnome_desktop.run([sys.executable, "-c", SCREENSHOT_SCRIPT, str(out)], 60, cwd=REPO_ROOT,
                             env=deskeye_env(gnome_desktop, home))
    assert proc.returncode == 0, proc.stderr
    assert "xdg-desktop-portal Screenshot (GNOME) Rect(left=0, top=0, width=1280, height=800)" in proc.stdout
    from PIL import Image
    with Image.open(out) as strip:
        assert strip.size == (1280, 200)
        dark = sum(strip.convert("L").histogram()[:80])
    assert 2_000 < dark < 200_000, dark               # black letters on white: the window's line of text


def sent_image(body: dict):
    """The screen frame in a chat request the app sent (a PNG data URL), as an image; None if it has none."""
    from PIL import Image
    for message in body.get("messages", []):
        for part in message.get("content", []) if isinstance(message.get("content"), list) else []:
            url = part.get("image_url", {}).get("url", "") if isinstance(part, dict) else ""
            if url.startswith("data:image/"):
                return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")
    return None


@on_gnome
def test_run_sends_the_native_window_it_sees_through_the_portal(gnome_desktop, native_window, home, tmp_path):
    """`deskeye run` in the GNOME session: its capture loop's frame of the region, as sent to the model server (a
    recording stand-in), shows the native window's text (read back with DeskEye's own OCR reader)."""
    from inference_worker.engines.ocr.reader import OcrReader

    consent(gnome_desktop, tmp_path)
    with RecordingServer() as recorder:
        home[1].write_text(f'[worker]\nurl = "{recorder.url}"\napi_key = "test"\nremote_model = "recorder"\n'
                           f'ocr_first = false\n[capture]\ninterval_s = 0.5\nregion = "{REGION}"\n'
                           '[overlay]\nfade_after_s = 0.0\n[hooks]\ndry_run = true\n', encoding="utf-8")
        proc = gnome_desktop.popen([sys.executable, "-m", "deskeye.cli", "--settings", str(home[1]), "run"],
                                   cwd=REPO_ROOT, env=deskeye_env(gnome_desktop, home), stdin=subprocess.DEVNULL,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            body = recorder.wait_for_request(lambda body: sent_image(body) is not None, 90)
            assert proc.poll() is None, "deskeye run stopped"
        finally:
            stop_inside(proc, timeout_s=30)
        output = proc.stdout.read()
    assert body is not None, f"no frame reached the model server:\n{output}"
    image = sent_image(body)
    text = " ".join(line.text for line in OcrReader().read(image).lines).lower()
    assert all(word in text for word in WORDS), (text, output)
    assert "capture failed" not in output and "Traceback" not in output, output


@on_gnome
def test_without_a_saved_token_deskeye_says_gnome_asks_once(gnome_desktop, native_window, home):
    """No token yet: the desktop shows its dialog, and DeskEye says so first. The test does not answer it: a SIGTERM
    stops DeskEye's wait for the answer at once, and the portal closes the dialog. Last in the file: it leaves a
    dialog being closed."""
    argv = [sys.executable, "-m", "deskeye.cli", "--settings", str(home[1]), "describe", "--engine", "ocr"]
    proc = gnome_desktop.popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                               env=deskeye_env(gnome_desktop, home))
    said: list[str] = []
    reader = threading.Thread(target=lambda: said.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        assert wait_until(lambda: any(CONSENT in line for line in said) or proc.poll() is not None, 60), said
        assert proc.poll() is None, "".join(said)     # waiting for the user's answer (bounded)
        line = next(line for line in said if CONSENT in line)
        assert "screencast-restore-token" in line, line
        stopping = time.monotonic()
        stop_inside(proc)
        assert time.monotonic() - stopping < STOP_S, "SIGTERM did not stop the wait for the user's answer"
    finally:
        stop_inside(proc)
        reader.join(10)


@pytest.mark.parametrize("uri, why", [
    ("https://example.org/shot.png", "not a local file:// URI"),
    ("file://otherhost/tmp/shot.png", "not a local file:// URI"),
    ("file:shot.png", "not an absolute path"),
    ("file:///tmp/shot.png?x=1", "not a local file:// URI"),
])
def test_a_screenshot_uri_that_is_not_a_local_file_is_refused(uri, why):
    from deskeye.see.portal_screenshot import screenshot_path
    with pytest.raises(CaptureError, match=why):
        screenshot_path(uri)
    assert screenshot_path("file:///tmp/Screenshot%20one.png") == Path("/tmp/Screenshot one.png")


def test_only_a_regular_file_of_this_user_is_read_as_a_screenshot(tmp_path):
    from deskeye.see.portal_screenshot import read_screenshot
    shot = tmp_path / "shot.png"
    shot.write_bytes(b"png")
    assert read_screenshot(shot) == b"png"
    (tmp_path / "link.png").symlink_to(shot)
    os.mkfifo(tmp_path / "fifo.png")
    for name, why in (("link.png", "link.png: Too many levels of symbolic links"), ("fifo.png", "not a regular file"),
                      ("missing.png", "No such file")):
        with pytest.raises(CaptureError, match=why):
            read_screenshot(tmp_path / name)


def test_the_restore_token_is_kept_0600_and_only_a_token_is_kept(tmp_path, caplog):
    from deskeye.see.portal_token import load_token, save_token
    path = tmp_path / "state" / "deskeye" / "screencast-restore-token"
    save_token("5bb1dd9a-1a32-4f66-9aba-792270c6b2ea", path)
    assert load_token(path) == "5bb1dd9a-1a32-4f66-9aba-792270c6b2ea"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    save_token("../../etc/passwd; rm -rf /", path)          # a reply that is no token is never written
    assert load_token(path) == "5bb1dd9a-1a32-4f66-9aba-792270c6b2ea"
    path.write_text("not a token\n" * 3)
    assert load_token(path) == "" and "does not hold a restore token" in caplog.text


def test_a_first_frame_is_waited_for_longer_where_the_compositor_streams_without_a_gpu():
    """GNOME and KDE stream from memory: a first frame later than 5 s there means a busy machine, and falling back to
    screenshots would flash GNOME's screen at every grab. xdg-desktop-portal-wlr sends none without a GPU: soon off."""
    from deskeye.see.portal_screencast import FIRST_FRAME_PATIENT_S, FIRST_FRAME_TIMEOUT_S, first_frame_timeout_s

    assert FIRST_FRAME_PATIENT_S > FIRST_FRAME_TIMEOUT_S
    for desktop in ("GNOME", "ubuntu:GNOME", "KDE", "kde"):
        assert first_frame_timeout_s({"XDG_CURRENT_DESKTOP": desktop}) == FIRST_FRAME_PATIENT_S, desktop
    for desktop in ("sway", "Hyprland", "river", "", "X-Cinnamon"):
        assert first_frame_timeout_s({"XDG_CURRENT_DESKTOP": desktop}) == FIRST_FRAME_TIMEOUT_S, desktop
    assert first_frame_timeout_s({}) == FIRST_FRAME_TIMEOUT_S
