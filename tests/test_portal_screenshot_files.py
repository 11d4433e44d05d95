"""The Screenshot portal leaves no picture of the screen on disk (issue 23, a privacy gap of Deliver 2).

Each portal screenshot is a file: GNOME 43 writes a new ~/Screenshot.png, Screenshot-1.png, ... for every shot, and
xdg-desktop-portal-wlr (sway) overwrites /tmp/out.png. DeskEye takes one every capture interval where no stream
comes, so without care a user's home fills with pictures of exactly what the exclusions protect. DeskEye deletes the
file the portal answered for its own request, once read, and nothing else: the rule (deskeye/see/portal_screenshot.py
`remove_screenshot`) is checked on real files (a link, a file replaced meanwhile, an old file, another user's), then
end to end with the real portals: headless GNOME (tests/fixtures/gnome.py; DeskEye inside its namespaces, as the
desktop's programs run) and headless sway with xdg-desktop-portal-wlr, whose fixed /tmp/out.png is made private to
this test (tests/fixtures/sway.py `start_portal(private_tmp=True)`: a mount namespace with its own /tmp).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from deskeye.see.portal_screenshot import CLOCK_SLACK_S, read_screenshot_file, remove_screenshot
from tests.fixtures.deskeye_process import REPO_ROOT
from tests.fixtures.gnome import gnome_desktop  # noqa: F401 - a fixture
from tests.fixtures.sway import sway_desktop  # noqa: F401 - a fixture

NUM_GRABS = 3
USER_PICTURE = b"the user's own picture, not DeskEye's"

# Grabs as the app's capture thread does, with the backend the session gives where no stream comes.
GRABS_SCRIPT = """
import logging, sys
logging.basicConfig(level=logging.WARNING)
from deskeye.see.geometry import Rect
from deskeye.see.portal_screenshot import PortalScreenshotBackend
from deskeye.see.session import Session
backend = PortalScreenshotBackend(Session.detect())
try:
    for _ in range(int(sys.argv[1])):
        print("grabbed", backend.grab(Rect(0, 0, 400, 300)).size, flush=True)
finally:
    backend.close()
"""


def on_a_desktop(test):
    """A test on a real Wayland desktop with its portal: slow, with subprocesses."""
    for mark in (pytest.mark.desktop, pytest.mark.subprocess, pytest.mark.slow):
        test = mark(test)
    return test


def read_then_remove(path, since_s: float, change=None) -> str:
    _data, read = read_screenshot_file(path)
    if change is not None:
        change()
    return remove_screenshot(path, read, since_s)


# ------------------------------------------------------------------ the rule, on real files

def test_the_file_just_read_is_deleted(tmp_path):
    shot = tmp_path / "Screenshot-1.png"
    asked_s = time.time()
    shot.write_bytes(b"png")
    assert read_then_remove(shot, asked_s) == "" and not shot.exists()


def test_a_file_written_before_the_request_is_left(tmp_path):
    shot = tmp_path / "Screenshot.png"
    shot.write_bytes(USER_PICTURE)
    hour_ago = time.time() - 3600
    os.utime(shot, (hour_ago, hour_ago))
    assert read_then_remove(shot, time.time()) == "it was written before DeskEye asked for it"
    assert shot.read_bytes() == USER_PICTURE
    assert read_then_remove(shot, hour_ago + CLOCK_SLACK_S / 2) == ""      # within the clock's slack: its own


def test_a_file_replaced_after_it_was_read_is_left(tmp_path):
    shot, other = tmp_path / "out.png", tmp_path / "other.png"
    asked_s = time.time()
    shot.write_bytes(b"png")
    other.write_bytes(USER_PICTURE)
    assert read_then_remove(shot, asked_s, lambda: other.replace(shot)) == "it is no longer the file DeskEye read"
    assert shot.read_bytes() == USER_PICTURE


def test_a_link_put_in_its_place_is_left_and_its_target_kept(tmp_path):
    shot, target = tmp_path / "out.png", tmp_path / "precious.png"
    asked_s = time.time()
    shot.write_bytes(b"png")
    target.write_bytes(USER_PICTURE)

    def swap():
        shot.unlink()
        shot.symlink_to(target)
    assert read_then_remove(shot, asked_s, swap) == "it is no longer a regular file"
    assert shot.is_symlink() and target.read_bytes() == USER_PICTURE


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_file_given_to_another_user_is_left(tmp_path):
    shot = tmp_path / "out.png"
    asked_s = time.time()
    shot.write_bytes(b"png")
    assert read_then_remove(shot, asked_s, lambda: os.chown(shot, 65534, 65534)) == "it belongs to another user"
    assert shot.exists()


# ------------------------------------------------------------------ the real portals

@on_a_desktop
def test_gnome_screenshots_leave_no_file_and_the_users_own_stays(gnome_desktop):  # noqa: F811
    gnome_desktop.allow_screenshots()
    home = gnome_desktop.home
    (home / "Pictures").mkdir(exist_ok=True)
    own = home / "Screenshot.png"                      # the user's picture, of the name GNOME gives its first
    own.write_bytes(USER_PICTURE)
    before = os.stat(own)
    env = gnome_desktop.env(PYTHONPATH=str(REPO_ROOT), NO_AT_BRIDGE="1")
    proc = gnome_desktop.run([sys.executable, "-c", GRABS_SCRIPT, str(NUM_GRABS)], 120, cwd=REPO_ROOT, env=env)
    assert proc.returncode == 0 and proc.stdout.count("grabbed (400, 300)") == NUM_GRABS, proc.stdout + proc.stderr
    left = sorted(str(p.relative_to(home)) for folder in (home, home / "Pictures") for p in folder.glob("*.png"))
    assert left == ["Screenshot.png"], f"pictures of the screen left on disk: {left}\n{proc.stderr}"
    assert own.read_bytes() == USER_PICTURE and os.stat(own).st_mtime == before.st_mtime
    assert "left on disk" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@on_a_desktop
def test_sway_screenshots_leave_no_out_png(sway_desktop, tmp_path):  # noqa: F811
    sway_desktop.start_portal(private_tmp=True)        # its /tmp/out.png is this test's alone
    sway_desktop.open_window("Notes", "org.example.notes", text="Shopping list")
    argv = sway_desktop.command([sys.executable, "-c", GRABS_SCRIPT, str(NUM_GRABS)])
    env = sway_desktop.env(PYTHONPATH=str(REPO_ROOT), NO_AT_BRIDGE="1", HOME=str(tmp_path))
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, env=env)
    assert proc.returncode == 0 and proc.stdout.count("grabbed (400, 300)") == NUM_GRABS, \
        f"{proc.stdout}{proc.stderr}\n--- the portal:\n{sway_desktop.portal_log()}"
    out = sway_desktop.tmp() / "out.png"
    assert not out.exists(), f"xdg-desktop-portal-wlr's screenshot {out} was left on disk\n{proc.stderr}"
    assert "left on disk" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "Pictures").exists()
