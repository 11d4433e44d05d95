"""Settings apply while DeskEye runs: the real `deskeye run` on a test desktop (Xvfb, openbox, a tray), its settings
file edited while it runs as a user would (saved in place, or saved to a temporary file and renamed over it, as most
editors do), in an English and a Chinese session.

What is measured is what the user gets: the overlay's text as drawn on the screen (the height of its first line in
pixels, read from a screenshot of the overlay window), what the app says (its overlay, read with the OCR reader, and
its log on stderr) and what `deskeye settings` prints while it runs.

The app needs no model here: its worker is an external URL nothing listens on and its capture interval is a day, so
nothing but what a test does puts text on the overlay (the pause hotkey, and the settings notices). The last two
tests need no desktop: the watcher reading a file caught halfway through a save, and `deskeye settings` next to the
run folder a killed run left behind.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
import time
import tomllib

import numpy as np
import pytest
import tomli_w

from tests.fixtures.deskeye_process import REPO_ROOT, start_deskeye
from tests.fixtures.desktop import start_desktop
from tests.fixtures.polling import wait_until

pytestmark = [pytest.mark.desktop, pytest.mark.subprocess]

LOCALES = ["en_US.UTF-8", "zh_CN.UTF-8"]
BASE_SETTINGS = {
    "capture": {"interval_s": 86_400.0},                  # no automatic describe: only the tests' texts show
    "overlay": {"fade_after_s": 0.0, "alpha": 1.0},       # the text stays, drawn opaque (pixels as painted)
    "worker": {"url": "http://127.0.0.1:9", "ocr_first": False},   # no worker process: nothing listens there
}
PAUSE_KEYS = "ctrl+alt+p"
BIG_FONT = 24                     # points; DeskEye's default is 11
WHITE = 200                       # the answer's text is white on a dark background: every channel at least this
NEW_TEXT_TIMEOUT_S = 30.0         # the watcher looks every second; the machine may be slow


def settings_with(**sections: dict) -> dict:
    merged = {name: dict(values) for name, values in BASE_SETTINGS.items()}
    for name, values in sections.items():
        merged.setdefault(name, {}).update(values)
    return merged


def save_in_place(path, data: dict) -> None:
    path.write_text(tomli_w.dumps(data), encoding="utf-8")


def save_by_rename(path, data: dict) -> None:
    temp = path.with_name(f".{path.name}.swp")
    temp.write_text(tomli_w.dumps(data), encoding="utf-8")
    os.replace(temp, path)


class Output:
    """Every line `deskeye run` writes (stdout and stderr), collected by a thread from the ready line on."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        while select.select([proc.stdout], [], [], 60)[0]:
            line = proc.stdout.readline()
            if not line:
                return
            self.lines.append(line)

    def count(self, *fragments: str) -> int:
        return sum(all(f in line for f in fragments) for line in list(self.lines))


@pytest.fixture(scope="module", params=LOCALES)
def running(request):
    """`deskeye run` in a session of the locale; the tests of the module share it, in file order."""
    with pytest.MonkeyPatch.context() as session:               # the desktop's programs and DeskEye's get it
        session.setenv("LANG", request.param)
        session.delenv("LC_ALL", raising=False)
        session.delenv("LANGUAGE", raising=False)
        desktop = start_desktop(1280, 800, tray="trayer")
        app = None
        try:
            app = start_deskeye(desktop, settings=tomli_w.dumps(settings_with()))
            assert app.read_until("deskeye: watching", 120), "".join(app.output)
            yield {"app": app, "output": Output(app.proc), "settings": desktop.home / "settings.toml",
                   "env": desktop.env(PYTHONPATH=str(REPO_ROOT)), "default_height": None}
        finally:
            if app is not None:
                app.stop()
            desktop.stop()


def overlay_image(app):
    """The overlay window's pixels now, or None while it is hidden."""
    rect = app.overlay_rect()
    if rect is None:
        return None
    import mss
    from PIL import Image
    with mss.MSS(display=app.desktop.display.name) as sct:
        shot = sct.grab({"left": rect[0], "top": rect[1], "width": rect[2], "height": rect[3]})
    return Image.frombytes("RGB", shot.size, shot.bgra, "raw", "BGRX")


def next_overlay_image(app, previous, timeout_s: float = NEW_TEXT_TIMEOUT_S):
    """The overlay once it shows something else than `previous` (None: hidden) and has stopped changing."""
    before = None if previous is None else previous.tobytes()

    def changed_and_still():
        first = overlay_image(app)
        if first is None or first.tobytes() == before:
            return None
        time.sleep(0.3)
        second = overlay_image(app)
        return second if second is not None and second.tobytes() == first.tobytes() else None
    return wait_until(changed_and_still, timeout_s, interval_s=0.2)


def first_line_height(image) -> int:
    """Height in pixels of the first line of the overlay's text as drawn: its white ink from top to bottom."""
    ink_rows = (np.asarray(image).min(axis=2) >= WHITE).any(axis=1)
    rows = np.flatnonzero(ink_rows)
    assert rows.size, "the overlay shows no text"
    top = bottom = rows[0]
    while bottom + 1 < ink_rows.size and ink_rows[bottom + 1]:
        bottom += 1
    return int(bottom - top + 1)


def pause_and_resume(ctx) -> int:
    """Press the pause hotkey: the notice DeskEye shows for it is measured; a second press resumes."""
    app = ctx["app"]
    shown = overlay_image(app)
    app.desktop.xdotool("key", PAUSE_KEYS)
    paused = next_overlay_image(app, shown)
    assert paused is not None, "the pause hotkey put no notice on the overlay"
    app.desktop.xdotool("key", PAUSE_KEYS)
    assert next_overlay_image(app, paused) is not None, "resuming put no notice on the overlay"
    return first_line_height(paused)


def deskeye_settings(ctx) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deskeye.cli", "--settings", str(ctx["settings"]), "settings"],
                          env=ctx["env"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)


def deskeye_settings_mentioning(ctx, text: str) -> subprocess.CompletedProcess | None:
    """`deskeye settings` once its output mentions `text` (or it fails)."""
    def attempt():
        done = deskeye_settings(ctx)
        return done if done.returncode != 0 or text in done.stdout else None
    return wait_until(attempt, NEW_TEXT_TIMEOUT_S, interval_s=1.0)


@pytest.mark.slow
def test_a_new_font_size_draws_the_next_text_in_that_size(running):
    default_height = pause_and_resume(running)                 # the pause notice at the default 11 points
    running["default_height"] = default_height
    app = running["app"]
    shown = overlay_image(app)
    save_in_place(running["settings"], settings_with(overlay={"font_size": BIG_FONT}))
    notice = next_overlay_image(app, shown)                     # what DeskEye says about the change, if anything
    bigger = pause_and_resume(running)                          # the next text, whatever it is
    ratio = bigger / default_height
    assert 1.7 <= ratio <= 2.7, (f"the pause notice is {bigger} px high after font_size went from 11 to {BIG_FONT} "
                                 f"points ({default_height} px before): the new size was not applied")
    assert notice is not None and 1.7 <= first_line_height(notice) / default_height <= 2.7, \
        "the notice of the change was not drawn in the new size"


@pytest.mark.slow
def test_a_bad_edit_keeps_the_settings_in_effect_and_names_the_key_once(running):
    app, output = running["app"], running["output"]
    assert running["default_height"], "runs after the font size test"
    shown = overlay_image(app)
    save_by_rename(running["settings"], settings_with(overlay={"font_size": 500}))
    error = next_overlay_image(app, shown)
    assert error is not None, "a bad edit of the settings file was not reported on the overlay"
    said = app.overlay_text().lower()                           # the overlay as the user reads it
    assert "font" in said and "size" in said, f"the overlay does not name the key: {said!r}"
    assert wait_until(lambda: output.count("overlay.font_size", "500", "72"), 10) == 1, output.lines
    time.sleep(3)                                               # three more looks at the unchanged bad file
    assert output.count("overlay.font_size", "500") == 1, "the same bad edit was reported more than once"
    ratio = pause_and_resume(running) / running["default_height"]
    assert 1.7 <= ratio <= 2.7, "a bad font_size changed the overlay's text; the old value must stay in effect"


@pytest.mark.slow
def test_a_changed_model_is_pending_a_restart_said_once_and_shown_by_deskeye_settings(running):
    app, output = running["app"], running["output"]
    model = "/models/a-vision-model"
    shown = overlay_image(app)
    save_by_rename(running["settings"], settings_with(overlay={"font_size": BIG_FONT}, worker={"model": model}))
    done = deskeye_settings_mentioning(running, model)          # once the running app has seen the change
    assert done is not None and done.returncode == 0, done
    in_effect = tomllib.loads(done.stdout)
    assert in_effect["worker"]["model"] == "", "`deskeye settings` shows the file's model as in effect"
    assert in_effect["overlay"]["font_size"] == BIG_FONT
    pending = [line for line in done.stdout.splitlines() if line.startswith("#") and "worker.model" in line]
    assert pending and model in pending[0], f"worker.model is not listed as pending a restart:\n{done.stdout}"
    assert next_overlay_image(app, shown) is not None, "the changed model was not mentioned on the overlay"
    assert "model" in app.overlay_text().lower()
    assert wait_until(lambda: output.count("worker.model"), 10) == 1, output.lines

    shown = overlay_image(app)                                  # another change: the model is not said again
    save_in_place(running["settings"], settings_with(overlay={"font_size": BIG_FONT, "margin_px": 24},
                                                     worker={"model": model}))
    assert next_overlay_image(app, shown) is not None
    time.sleep(2)
    assert output.count("worker.model") == 1, output.lines
    assert model in deskeye_settings(running).stdout


def test_a_save_caught_halfway_is_no_error_and_a_fixed_file_is_said(tmp_path):
    from deskeye.live_settings import SettingsWatcher
    from deskeye.settings import load_settings
    path = tmp_path / "settings.toml"
    save_in_place(path, settings_with())
    watcher = SettingsWatcher(path, load_settings(path))
    path.write_text('[overlay]\nfont_size = ', encoding="utf-8")          # an editor halfway through its save
    assert watcher.poll() is None
    save_in_place(path, settings_with(overlay={"font_size": BIG_FONT}))  # ... and done
    update = watcher.poll()
    assert update.applied == ("overlay.font_size",) and not update.error
    assert watcher.in_effect.overlay.font_size == BIG_FONT

    path.write_text('[overlay]\nfont_size = "big"\n', encoding="utf-8")  # a real mistake: said at the next look
    assert watcher.poll() is None
    told = watcher.poll()
    assert told.error and "overlay.font_size" in told.message and watcher.in_effect.overlay.font_size == BIG_FONT
    assert watcher.poll() is None                                        # once
    save_in_place(path, settings_with(overlay={"font_size": BIG_FONT}))  # put back as it was: the user hears so
    assert watcher.poll().message and watcher.in_effect.overlay.font_size == BIG_FONT


def test_deskeye_settings_ignores_the_state_a_killed_run_left(tmp_path):
    """A run killed with SIGKILL leaves its run folder; `deskeye settings` then shows the file, not that run's state."""
    path = tmp_path / "settings.toml"
    save_in_place(path, settings_with(overlay={"font_size": BIG_FONT}))
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TMPDIR": str(tmp_path)}
    leave_state = ("import sys; from pathlib import Path; from deskeye.lifecycle import RunFolder; "
                   "from deskeye.live_settings import RUN_STATE_NAME, SettingsWatcher; "
                   "from deskeye.settings import Settings; folder = RunFolder(); "
                   "SettingsWatcher(Path(sys.argv[1]), Settings(), state_file=folder.path / RUN_STATE_NAME)"
                   ".write_state(); print(folder.path)")
    left = subprocess.run([sys.executable, "-c", leave_state, str(path)], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    assert left.startswith(str(tmp_path)) and os.listdir(left), "the dead run left no state to ignore"
    done = subprocess.run([sys.executable, "-m", "deskeye.cli", "--settings", str(path), "settings"], env=env,
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert tomllib.loads(done.stdout)["overlay"]["font_size"] == BIG_FONT and "running DeskEye" not in done.stdout
