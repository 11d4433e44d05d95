"""DeskEye's own windows on Wayland: the overlay shows above other windows, and DeskEye never describes it (issue 23,
Deliver 4).

On Wayland the overlay is a Tk window through Xwayland, and the portal's frames are the compositor's own pixels, so
they contain it: DeskEye must mask it out of every frame it sends. Two real desktops, each with a native GTK window
(GDK_BACKEND=wayland) holding a known line of text under the watched region (the whole monitor), and the real
`deskeye run` sending its frames to a recording model server (tests/fixtures/openai_recorder.py, a stand-in for
the model; its answer is what the overlay shows):
- headless GNOME (tests/fixtures/gnome.py): frames from the portal's ScreenCast; the overlay's place known from
  Xwayland's X11 geometry (GNOME tells no program where native windows are);
- headless sway (tests/fixtures/sway.py): frames from the portal's Screenshot (no GPU: no stream); the window list
  from sway's IPC, which does not list the overlay (an override-redirect X11 window is not managed by sway).
Where the overlay is and that it is on top is read from the compositor's own pixels (gnome-shell's screenshot without
a flash on GNOME, `grim` on sway), never from Xwayland. After the first describe the test asks for another through `deskeye trigger
describe` (the route for Wayland hotkeys) and waits several capture intervals: every frame the app sent holds the
native window's text and none of the overlay's, and where the overlay is on screen the frame is masked.
"""

from __future__ import annotations

import base64
import io
import subprocess
import sys

import pytest

from deskeye.see.capture import MASK_COLOUR
from deskeye.ui.overlay import COLOURS, Kind
from tests.fixtures.deskeye_process import REPO_ROOT
from tests.fixtures.gnome import gnome_desktop, open_native_window, stop_inside  # noqa: F401 - a fixture
from tests.fixtures.openai_recorder import ANSWER, RecordingServer
from tests.fixtures.polling import wait_until
from tests.fixtures.processes import stop_process
from tests.fixtures.sway import WIDTH, HEIGHT, sway_desktop  # noqa: F401 - a fixture

NATIVE_TEXT = "NATIVE WAYLAND WINDOW 4217"
NATIVE_WORDS = ("native", "wayland", "4217")
OVERLAY_WORDS = ("deskeye", ANSWER["summary"].lower(), "thinking", "privacy")     # anything the overlay shows
ANSWER_COLOUR = tuple(int(COLOURS[Kind.ANSWER][i:i + 2], 16) for i in (1, 3, 5))
OVERLAY_WIDTH_PX, MARGIN_PX = 420, 16           # the settings' defaults (the test monitors have scale 1)
ASK_PROMPT_WORDS = "ask deskeye about your screen"
NUM_TICKS = 6                                   # capture intervals watched once the overlay shows
INTERVAL_S = 0.5
START_TIMEOUT_S = 120.0


def on_a_desktop(test):
    """A test on a real Wayland desktop running the real app: slow, with subprocesses."""
    for mark in (pytest.mark.desktop, pytest.mark.subprocess, pytest.mark.slow):
        test = mark(test)
    return test


def settings_text(recorder) -> str:
    """The whole monitor watched (the overlay's corner too), the overlay opaque (its colour is found exactly in the
    compositor's pixels) and never fading."""
    return (f'[worker]\nurl = "{recorder.url}"\napi_key = "test"\nremote_model = "recorder"\nocr_first = false\n'
            f'startup_timeout_s = 90.0\nrequest_timeout_s = 90.0\n'
            f'[capture]\ninterval_s = {INTERVAL_S}\nregion = "0,0,{WIDTH},{HEIGHT}"\n'
            '[overlay]\nfade_after_s = 0.0\nalpha = 1.0\n[hooks]\ndry_run = true\n')


def app_env(tmp_path, *more: str) -> dict[str, str]:
    dirs = {"PYTHONPATH": str(REPO_ROOT), "NO_AT_BRIDGE": "1", "HF_HUB_OFFLINE": "1"}
    for name in ("XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", *more):
        (tmp_path / name.lower()).mkdir(mode=0o700, exist_ok=True)
        dirs[name] = str(tmp_path / name.lower())
    return dirs


def sent_frames(recorder) -> list:
    """The screen frames of the chat requests the app sent so far, in order."""
    from PIL import Image
    frames = []
    for body in list(recorder.requests):
        for message in body.get("messages", []):
            for part in message.get("content", []) if isinstance(message.get("content"), list) else []:
                url = part.get("image_url", {}).get("url", "") if isinstance(part, dict) else ""
                if url.startswith("data:image/"):
                    frames.append(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB"))
    return frames


def read_text(image) -> str:
    from inference_worker.engines.ocr.reader import OcrReader
    return " ".join(line.text for line in OcrReader().read(image).lines).lower()


def overlay_box(screen) -> tuple[int, int, int, int] | None:
    """(left, top, right, bottom) of the overlay's answer colour in the compositor's pixels, None if not shown."""
    import numpy as np
    pixels = np.asarray(screen.convert("RGB"))
    ys, xs = np.nonzero((pixels == np.array(ANSWER_COLOUR, dtype=pixels.dtype)).all(axis=2))
    if len(xs) < 1000:                  # a few stray pixels of that colour are no window
        return None
    return int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1


def check_overlay_on_screen(screen, box) -> None:
    """The overlay, on top of the full-screen native window, in the monitor's bottom-right corner (the watched
    region's, here the whole monitor), showing the answer."""
    left, top, right, bottom = box
    assert WIDTH - MARGIN_PX - 4 <= right <= WIDTH - MARGIN_PX + 4, box           # its corner, at its margin
    assert HEIGHT - MARGIN_PX - 60 <= bottom <= HEIGHT, box                       # (a panel may take a strip)
    assert abs((right - left) - OVERLAY_WIDTH_PX) <= 4 and bottom - top >= 40, box
    text = read_text(screen.crop(box))
    assert ANSWER["summary"].lower() in text, text                                # drawn above the window


def check_frames(frames, box) -> None:
    """Every frame holds the native window's text and none of the overlay's. Once the overlay shows (after the
    first frame), no pixel of its answer colour is in a frame, and the frame is masked where the overlay is: one
    solid rectangle at the overlay's corner and of its width (the region is the whole monitor: frame pixels are
    screen pixels). Its height is the overlay's when the frame was grabbed, which follows the overlay's text then (a
    notice, "thinking", a growing answer): the test's screenshot `box` may show another."""
    assert len(frames) >= 2, f"{len(frames)} frame(s) sent"
    for number, frame in enumerate(frames):
        text = read_text(frame)
        assert all(word in text for word in NATIVE_WORDS), (number, text)
        assert not any(word in text for word in OVERLAY_WORDS), f"frame {number} shows the overlay: {text}"
    for number, frame in enumerate(frames[1:], 1):         # the first was grabbed before the answer showed
        assert overlay_box(frame) is None, (number, "the overlay's pixels are in the frame")
        mask = masked_box(frame, box, whole_column=True)
        assert mask is not None, (number, "nothing is masked")
        colours = frame.crop(mask).getcolors(16)
        assert colours is not None and [c for _n, c in colours] == [MASK_COLOUR], (number, mask, colours)
        assert (mask[0], mask[2], mask[3]) == (box[0], box[2], box[3]), \
            (number, mask, box, "the mask is not where the compositor shows the overlay")


def masked_box(frame, box, slack_px: int = 12, *, whole_column: bool = False) -> tuple[int, int, int, int] | None:
    """The box of MASK_COLOUR pixels within `slack_px` around `box` (the Xwayland geometry the mask was painted at,
    as the compositor's pixels show it: equal to `box` where the two coordinate systems agree); `whole_column`: in
    `box`'s columns from the frame's top to its bottom (the native window's black text lies left of them)."""
    import numpy as np
    left, top = max(box[0] - slack_px, 0), 0 if whole_column else max(box[1] - slack_px, 0)
    bottom = frame.height if whole_column else box[3] + slack_px
    around = np.asarray(frame.convert("RGB").crop((left, top, box[2] + slack_px, bottom)))
    ys, xs = np.nonzero((around == np.array(MASK_COLOUR, dtype=around.dtype)).all(axis=2))
    if not len(xs):
        return None
    return left + int(xs.min()), top + int(ys.min()), left + int(xs.max()) + 1, top + int(ys.max()) + 1


def keep_for_a_look(folder, screen, frames) -> None:
    """The compositor's screen and the frames sent, as PNG files in the test's folder (for a failure's reader)."""
    screen.save(folder / "compositor.png")
    for number, frame in enumerate(frames):
        frame.save(folder / f"sent-{number}.png")


def with_output(failure: AssertionError, proc) -> str:
    """A failure seen while `deskeye run` ran (now stopped), with the end of what it printed."""
    return f"{failure}\n--- the end of what deskeye run printed:\n{proc.stdout.read()[-6000:]}"


def wait_for_overlay(screenshot, timeout_s: float = 60.0):
    """The compositor's screen once the overlay shows the answer and has stopped growing (a streamed answer grows
    it line by line): the same box on two screenshots in a row. (screen, box)."""
    seen = {"box": None, "screen": None}

    def settled() -> bool:
        screen = screenshot()
        box = overlay_box(screen)
        still = box is not None and box == seen["box"]
        seen.update(box=box, screen=screen)
        return still
    assert wait_until(settled, timeout_s, interval_s=0.3), \
        f"the overlay never showed, or never stopped changing, on the compositor's screen (last seen: {seen['box']})"
    return seen["screen"], seen["box"]


def watch_more(recorder, trigger) -> None:
    """Ask for one more describe (`deskeye trigger describe`) and let capture intervals pass."""
    before = len(sent_frames(recorder))
    done = trigger("describe")
    assert done.returncode == 0, done.stdout + done.stderr
    assert wait_until(lambda: len(sent_frames(recorder)) > before, 60), "the triggered describe sent nothing"
    wait_until(lambda: False, NUM_TICKS * INTERVAL_S)


# ------------------------------------------------------------------ GNOME

def the_ask_box_over_the_overlay(start, stop, screenshot, trigger, tmp_path, capture: str = ""):
    """`deskeye run` started with `start(argv)` (a Popen, ended by `stop(proc)`) on a desktop with a full-screen native
    window, `capture` added to its [capture] settings: the overlay and every frame sent are checked
    (`check_overlay_on_screen`, `check_frames`), then the Ask box is opened: whether it showed just above the overlay,
    as X11 window managers place it."""
    with RecordingServer() as recorder:
        path = tmp_path / "settings.toml"
        path.write_text(settings_text(recorder).replace("[capture]\n", "[capture]\n" + capture), encoding="utf-8")
        proc = start([sys.executable, "-m", "deskeye.cli", "--settings", str(path), "run"])
        try:
            assert wait_until(lambda: sent_frames(recorder), START_TIMEOUT_S), "no frame was sent"
            screen, box = wait_for_overlay(screenshot)
            watch_more(recorder, trigger)
            assert proc.poll() is None, "deskeye run stopped"
            assert trigger("ask").returncode == 0
            column = (box[0] - MARGIN_PX, max(box[1] - 200, 0), WIDTH, box[1])     # just above the overlay
            asking = wait_until(lambda: ASK_PROMPT_WORDS in (text := read_text(screenshot().crop(column)))
                                and text, 20, interval_s=0.3)
        except AssertionError as exc:
            stop(proc)
            raise AssertionError(with_output(exc, proc)) from None
        finally:
            stop(proc)
        output = proc.stdout.read()
        frames = sent_frames(recorder)
    keep_for_a_look(tmp_path, screen, frames)
    check_overlay_on_screen(screen, box)
    check_frames(frames, box)
    assert "Traceback" not in output, output
    return asking


@on_a_desktop
def test_on_gnome_the_overlay_is_on_top_and_never_described(gnome_desktop, tmp_path):  # noqa: F811
    """mutter places the Ask box where DeskEye asks, above the overlay, as X11 window managers do."""
    from PIL import Image

    env = gnome_desktop.env(**app_env(tmp_path))
    token = tmp_path / "xdg_state_home" / "deskeye" / "screencast-restore-token"
    token.parent.mkdir(mode=0o700)
    token.write_text(gnome_desktop.consent_to_screencast(), encoding="ascii")   # the user's yes to the ScreenCast
    token.chmod(0o600)
    window = open_native_window(gnome_desktop, "Native GTK window", NATIVE_TEXT)
    shot = tmp_path / "screen.png"

    def screenshot():
        gnome_desktop.screenshot(shot)                  # gnome-shell's own, without the portal's white flash
        with Image.open(shot) as image:
            return image.convert("RGB")

    def trigger(action: str):
        return gnome_desktop.run([sys.executable, "-m", "deskeye.cli", "trigger", action], 30, cwd=REPO_ROOT,
                                 env=env)

    def start(argv):
        return gnome_desktop.popen(argv, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
    try:
        asking = the_ask_box_over_the_overlay(start, lambda proc: stop_inside(proc, timeout_s=30), screenshot,
                                              trigger, tmp_path)
    finally:
        stop_process(window, timeout_s=5)
    assert asking, "the Ask box did not show above the overlay"          # where it goes on X11 too


# ------------------------------------------------------------------ sway

@on_a_desktop
def test_on_sway_the_overlay_is_on_top_and_never_described_and_the_ask_box_floats(sway_desktop,  # noqa: F811
                                                                                   tmp_path):
    """The Ask box is an ordinary X11 window: sway would tile it beside the user's window (half the screen each);
    as a dialog it floats above, at the output's centre (sway centres floating windows, whatever Tk asks)."""
    from PIL import Image

    sway_desktop.start_portal(private_tmp=True)        # its Screenshot's /tmp/out.png is this test's alone
    sway_desktop.open_window("Native notes", "org.example.notes", text=NATIVE_TEXT)    # tiled: the whole output
    app_home = sway_desktop.shared_folder("app")       # seen by DeskEye inside that /tmp too
    env = sway_desktop.env(**app_env(app_home, "XDG_RUNTIME_DIR"))
    shot = tmp_path / "screen.png"

    def screenshot():
        done = subprocess.run(["grim", str(shot)], capture_output=True, text=True, timeout=30, env=env)
        assert done.returncode == 0, done.stderr
        with Image.open(shot) as image:
            return image.convert("RGB")

    def trigger(action: str):
        return subprocess.run(sway_desktop.command([sys.executable, "-m", "deskeye.cli", "trigger", action]),
                              capture_output=True, text=True, timeout=30, cwd=REPO_ROOT, env=env)

    def ask_box():
        return next((w for w in sway_desktop.listed() if w.title == "Ask DeskEye"), None)
    with RecordingServer() as recorder:
        settings = app_home / "settings.toml"
        settings.write_text(settings_text(recorder), encoding="utf-8")
        proc = subprocess.Popen(sway_desktop.command([sys.executable, "-m", "deskeye.cli", "--settings",
                                                      str(settings), "run"]),
                                cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        try:
            assert wait_until(lambda: sent_frames(recorder), START_TIMEOUT_S), "no frame was sent"
            screen, box = wait_for_overlay(screenshot)
            watch_more(recorder, trigger)
            assert proc.poll() is None, "deskeye run stopped"
            assert trigger("ask").returncode == 0
            box_window = wait_until(ask_box, 30)
            native = next(w for w in sway_desktop.listed() if w.title == "Native notes")     # while it is open
            said = {}

            def prompt_shown():                         # sway lists the box a moment before Tk has drawn it
                said["text"] = read_text(screenshot())
                return ASK_PROMPT_WORDS in said["text"]
            wait_until(prompt_shown, 15, interval_s=0.3)
        except AssertionError as exc:
            stop_process(proc, timeout_s=30)
            raise AssertionError(with_output(exc, proc)) from None
        finally:
            stop_process(proc, timeout_s=30)
        output = proc.stdout.read()
        frames = sent_frames(recorder)
    keep_for_a_look(tmp_path, screen, frames)
    check_overlay_on_screen(screen, box)
    check_frames(frames, box)
    assert box_window is not None and box_window.is_floating, box_window
    assert native.rect.width == WIDTH, f"the Ask box took a tile from the user's window: {native.rect}"
    assert ASK_PROMPT_WORDS in said["text"], said["text"]                        # drawn, above the window
    assert "Traceback" not in output, output


# ------------------------------------------------------------------ the wait, alone

def test_a_grab_waits_for_deskeyes_windows_to_settle_but_not_for_ever():
    """A frame is not taken while the compositor may still show the overlay as it was; a streamed answer that keeps
    changing it delays the grab by at most MAX_SETTLE_WAITS * the settle time."""
    import threading
    import time

    from deskeye.see.capture import MAX_SETTLE_WAITS, _wait_own_windows_settled, own_windows_changed
    settle_s = 0.1
    own_windows_changed()
    started = time.monotonic()
    _wait_own_windows_settled(settle_s)
    assert settle_s * 0.9 <= time.monotonic() - started < settle_s * 3
    stop = threading.Event()

    def stream():                     # the overlay growing with every chunk of an answer
        while not stop.is_set():
            own_windows_changed()
            time.sleep(settle_s / 4)
    streaming = threading.Thread(target=stream)
    streaming.start()
    try:
        started = time.monotonic()
        _wait_own_windows_settled(settle_s)
        waited_s = time.monotonic() - started
    finally:
        stop.set()
        streaming.join()
    assert MAX_SETTLE_WAITS * settle_s * 0.9 <= waited_s < MAX_SETTLE_WAITS * settle_s + 0.5, waited_s
