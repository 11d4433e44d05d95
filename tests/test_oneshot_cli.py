"""`deskeye describe` / `deskeye ask` as real subprocesses, with a settings file in a temp dir and XDG dirs
isolated, so the developer's real config is never read. No model is configured: the worker uses OCR.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.processes import stop_process
from tests.fixtures.polling import wait_until
from tests.fixtures.text_image import render_text_png

pytestmark = [pytest.mark.desktop, pytest.mark.subprocess]

KEYS = {"summary", "key_objects", "engine", "latency_ms", "output_mode"}


@pytest.fixture
def cli(tmp_path):
    """Run `deskeye --settings <tmp>/settings.toml ARGS` in an isolated environment -> CompletedProcess."""
    settings = tmp_path / "settings.toml"
    settings.write_text("[worker]\nstartup_timeout_s = 60.0\nrequest_timeout_s = 60.0\n", encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "DESKEYE_", "WAYLAND_"))}
    env.pop("DISPLAY", None)
    for name in ("XDG_CONFIG_HOME", "XDG_RUNTIME_DIR", "XDG_CACHE_HOME", "XDG_DATA_HOME"):
        (tmp_path / name).mkdir(mode=0o700)
        env[name] = str(tmp_path / name)
    env["HF_HUB_OFFLINE"] = "1"

    def run(*args: str, display: str | None = None) -> subprocess.CompletedProcess:
        run_env = {**env, "DISPLAY": display} if display else env
        return subprocess.run([sys.executable, "-m", "deskeye.cli", "--settings", str(settings), *args],
                              capture_output=True, text=True, timeout=120, env=run_env)
    return run


@pytest.fixture
def text_image(tmp_path) -> Path:
    path = tmp_path / "screen.png"
    path.write_bytes(render_text_png(["Quarterly budget review", "Meeting at 3pm"]))
    return path


def _no_traceback(proc: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout


@pytest.mark.slow
def test_describe_image_json_prints_exactly_the_four_keys(cli, text_image):
    proc = cli("describe", "--image", str(text_image), "--json")
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.strip().splitlines()) == 1               # one JSON object, nothing else
    answer = json.loads(proc.stdout)
    assert set(answer) == KEYS
    assert answer["engine"] == "ocr" and answer["output_mode"] == "json_schema"
    summary = answer["summary"].lower()
    assert all(word in summary for word in ("quarterly", "budget", "review", "meeting")), answer
    assert isinstance(answer["key_objects"], list) and all(isinstance(k, str) for k in answer["key_objects"])
    assert isinstance(answer["latency_ms"], int) and answer["latency_ms"] > 0
    assert "starting the worker" in proc.stderr                     # progress goes to stderr
    _no_traceback(proc)


@pytest.mark.slow
def test_ask_with_an_image_in_human_format(cli, text_image):
    proc = cli("ask", "What does the meeting line say?", "--image", str(text_image))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "budget" in lines[0].lower()
    assert lines[-1].startswith("(ocr, ") and lines[-1].endswith(" ms)")
    _no_traceback(proc)


@pytest.mark.slow
def test_describe_a_region_of_the_real_screen(cli, open_window, xdisplay):
    """A real Tk window on Xvfb, grabbed with mss by `describe --region`, read by the OCR worker."""
    open_window("notes", "700x160+100+100", lines=["Deploy window closes Friday", "Invoice 4471 overdue"])
    proc = cli("describe", "--region", "100,100,700,160", "--json", display=xdisplay.name)
    assert proc.returncode == 0, proc.stderr
    answer = json.loads(proc.stdout)
    assert answer["engine"] == "ocr"
    assert "friday" in answer["summary"].lower() and "4471" in answer["summary"], answer


@pytest.fixture
def dark_terminal(xdisplay):
    """A real xterm at 100,500: white text on black, as a dark terminal looks (its region is far from uniformly
    black). Returned once its text is on the screen."""
    proc = subprocess.Popen(["xterm", "-bg", "black", "-fg", "white", "-fa", "DejaVu Sans Mono", "-fs", "22",
                             "-geometry", "32x3+100+500", "-T", "build - terminal", "-e", "sh", "-c",
                             "printf 'Build finished\\nTests passed 4471\\n'; exec sleep 600"],
                            env=xdisplay.env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    import mss
    from PIL import Image

    def text_drawn() -> bool:
        with mss.MSS(display=xdisplay.name) as sct:
            shot = sct.grab({"left": 100, "top": 500, "width": 400, "height": 60})
        return Image.frombytes("RGB", shot.size, shot.raw, "raw", "BGRX").getextrema()[0][1] > 200
    try:
        assert wait_until(text_drawn, 20), "the xterm never drew its text"
        yield proc
    finally:
        stop_process(proc, timeout_s=5)


@pytest.mark.slow
def test_describe_refuses_a_black_window_with_the_fix_and_reads_a_dark_terminal(cli, open_window, xdisplay,
                                                                                dark_terminal):
    """A uniformly black grab is not described (it is what X11 capture gets on Wayland, too); a dark terminal with
    text is not uniformly black, and is read."""
    open_window("Video - player", "400x200+800+500", blocks=[(0, 0, 400, 200, "#000000")])
    proc = cli("describe", "--region", "800,500,400,200", "--json", display=xdisplay.name)
    assert proc.returncode == 1 and proc.stdout == "", proc.stdout + proc.stderr
    assert ("deskeye: The screen grab of 400x200 at 800,500 is uniformly black, so DeskEye does not describe it. "
            "If a black window covers that region, move it or watch another region (capture.region).") in proc.stderr
    assert "X11 capture through Xwayland is black on Wayland" in proc.stderr and '"GNOME on Xorg"' in proc.stderr
    assert "starting the worker" not in proc.stderr
    _no_traceback(proc)

    proc = cli("describe", "--region", "100,500,500,120", "--json", display=xdisplay.name)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)["summary"]
    assert "build finished" in summary.lower() and "4471" in summary, summary


@pytest.mark.parametrize("make, expected", [
    (lambda d: d / "missing.png", "no such file"),
    (lambda d: d, "is a folder"),
    (lambda d: (d / "notes.png").write_text("not an image") and d / "notes.png", "not an image DeskEye can read"),
])
def test_a_bad_image_path_is_a_clear_error(cli, tmp_path, make, expected):
    path = make(tmp_path)
    proc = cli("describe", "--image", str(path), "--json")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.startswith(f"deskeye: --image {path}: {expected}")
    _no_traceback(proc)


def test_describe_the_screen_without_a_display_says_how_to_fix_it(cli):
    proc = cli("describe", "--json")
    assert proc.returncode == 1 and proc.stdout == ""
    assert "DISPLAY is not set" in proc.stderr and "--image FILE" in proc.stderr
    _no_traceback(proc)


def test_an_empty_question_is_a_usage_error(cli, text_image):
    proc = cli("ask", "  ", "--image", str(text_image))
    assert proc.returncode == 2 and "question is empty" in proc.stderr


def test_model_text_cannot_drive_the_terminal():
    from deskeye.worker.client import printable
    assert printable("ok\x1b]0;pwned\x07 \x1b[2J done") == "ok\\x1b]0;pwned\\x07 \\x1b[2J done"
    assert printable("plain text 中文") == "plain text 中文"


UNREACHABLE_WORKER = '[worker]\nurl = "http://127.0.0.1:9"\nstartup_timeout_s = 2.0\nrequest_timeout_s = 2.0\n'


@pytest.mark.slow
def test_ask_routes_a_quick_question_without_any_worker(cli, tmp_path):
    """The settings point at a worker that does not exist: a quick answer must not need one."""
    (tmp_path / "settings.toml").write_text(UNREACHABLE_WORKER, encoding="utf-8")
    from datetime import datetime
    before = datetime.now().astimezone()
    proc = cli("ask", "what time is it")
    after = datetime.now().astimezone()
    assert proc.returncode == 0, proc.stderr
    assert any(f"{t:%H:%M}" in proc.stdout for t in (before, after)), proc.stdout
    assert "starting the worker" not in proc.stderr
    answer = json.loads(cli("ask", "--json", "what time is it").stdout)
    assert answer["tier"] == "quick" and answer["engine"] == "quick:clock" and ":" in answer["summary"]
    _no_traceback(proc)


@pytest.mark.slow
def test_ask_next_meeting_without_a_calendar_says_how_to_set_one(cli, tmp_path):
    (tmp_path / "settings.toml").write_text(UNREACHABLE_WORKER, encoding="utf-8")
    proc = cli("ask", "when is my next meeting")
    assert proc.returncode == 1
    assert "providers.calendar_ics" in proc.stdout
    _no_traceback(proc)


@pytest.mark.slow
def test_ask_json_reports_the_tier_of_a_model_question(cli, text_image):
    proc = cli("ask", "--json", "What does the meeting line say?", "--image", str(text_image))
    assert proc.returncode == 0, proc.stderr
    answer = json.loads(proc.stdout)
    assert set(answer) == KEYS | {"tier"} and answer["tier"] in ("standard", "deep")


@pytest.mark.slow
def test_describe_region_over_an_excluded_window_refuses_with_the_reason(cli, open_window, xdisplay):
    """The terminal running the command is the active window; the password manager is merely in the region."""
    open_window("notes", "600x200+100+100", lines=["Deploy window closes Friday"])
    open_window("KeePassXC - Passwords.kdbx", "300x150+400+150", lines=["hunter2"])
    proc = cli("describe", "--region", "100,100,700,300", "--json", display=xdisplay.name)
    assert proc.returncode == 3 and proc.stdout == ""
    assert ("deskeye: DeskEye is not looking: a window in the watched region ('KeePassXC - Passwords.kdbx') "
            "matches the exclusion entry 'KeePass'.") in proc.stderr
    assert "starting the worker" not in proc.stderr
    proc = cli("ask", "what does this say?", "--region", "100,100,700,300", display=xdisplay.name)
    assert proc.returncode == 3 and "KeePassXC - Passwords.kdbx" in proc.stderr
    proc = cli("describe", "--region", "100,100,250,100", "--json", display=xdisplay.name)   # clear of it
    assert proc.returncode == 0 and "Deploy" in json.loads(proc.stdout)["summary"], proc.stderr


@pytest.mark.parametrize("args, message", [
    (("describe", "--region", "-5,0,100,100"), "deskeye: --region: width and height must be positive and X,Y not "
                                               "negative; got '-5,0,100,100'."),
    (("run", "--model", "/bad/path"), "deskeye: --model /bad/path: no such folder."),
    (("describe", "--model", "./nowhere", "--image", "x.png"), "deskeye: --model ./nowhere: no such folder."),
])
def test_bad_arguments_are_one_clear_line(cli, args, message):
    proc = cli(*args)
    assert proc.returncode == 2 and proc.stderr.startswith(message), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    _no_traceback(proc)


def test_settings_piped_into_head_prints_no_traceback(tmp_path):
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path)}
    done = subprocess.run(f"{sys.executable} -m deskeye.cli settings | head -1", shell=True, capture_output=True,
                          text=True, timeout=60, env=env)
    assert done.stdout.startswith("# settings file:") and len(done.stdout.splitlines()) == 1
    assert done.stderr == ""


def test_a_large_image_is_scaled_down_to_what_the_worker_accepts(tmp_path, capsys):
    from PIL import Image

    from deskeye.oneshot import load_image_png
    from deskeye.worker.endpoint import FALLBACK_LIMITS
    from inference_worker.config import DEFAULT_MAX_IMAGE_PIXELS
    assert FALLBACK_LIMITS.max_image_pixels == DEFAULT_MAX_IMAGE_PIXELS   # the app's fallback: the worker's default
    path = tmp_path / "big.png"
    Image.new("RGB", (400, 300), "white").save(path)
    png = load_image_png(path, max_pixels=30_000)
    import io
    with Image.open(io.BytesIO(png)) as small:
        assert small.width * small.height <= 30_000 and abs(small.width / small.height - 4 / 3) < 0.02
    assert "scaled down" in capsys.readouterr().err


@pytest.mark.slow
def test_ask_cuts_a_pasted_log_and_says_so_on_stderr(cli, text_image):
    """A question of 50,000 characters (a pasted log) is cut to what the app sends, keeping its end where the
    actual question usually is, and the user is told: the answer on stdout, the note on stderr."""
    question = "log line 12345 ok\n" * 2800 + "why did the last build fail?"
    proc = cli("ask", question, "--image", str(text_image))
    assert proc.returncode == 0, proc.stderr
    _no_traceback(proc)
    assert "deskeye: Your question was" in proc.stderr and f"{len(question):,} characters long" in proc.stderr
    assert "Your question was" not in proc.stdout
