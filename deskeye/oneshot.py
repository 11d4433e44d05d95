"""`deskeye describe` and `deskeye ask`: one frame (the screen or an image file), one answer, then exit.

stdout carries only the answer (with --json exactly one object: summary, key_objects, engine, latency_ms,
output_mode; `ask` adds `tier`); progress and errors go to stderr. `ask` routes like the Ask box: a quick question
is answered by a local provider without starting the worker. A screen grab honours the privacy exclusions with the
app's own message (the active window, and any excluded window in the region), and grabs the region the app watches
(deskeye/see/capture.py `watched_region`), naming it on stderr. An image file is read before the worker
starts (a bad one is refused at once) and scaled down, if it must be, to what the worker says it accepts.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from deskeye.errors import DeskEyeError, UsageError
from deskeye.language import ui_language
from deskeye.prompt import describe_question
from deskeye.settings import Settings
from deskeye.worker.client import Answer, WorkerClient, printable
from deskeye.worker.endpoint import FALLBACK_LIMITS, WorkerLimits
from deskeye.worker.supervisor import WorkerSupervisor

if TYPE_CHECKING:
    from PIL import Image

LOOKING_AT = "deskeye: looking at {width}x{height} at {left},{top} of monitor {monitor}"   # stderr, before a grab

FramePng = Callable[[WorkerLimits], "tuple[bytes, tuple]"]   # the frame as PNG for what the worker accepts, and its
                                                              # window facts


class PrivacyRefusal(DeskEyeError):
    """An excluded window is active or in the region: nothing was captured."""
    exit_code = 3


def cmd_describe(args, settings: Settings) -> int:
    answer = _ask_once(settings, describe_question(ui_language()), _frame(args, settings))
    _print_answer(answer, as_json=args.json)
    return 0


def cmd_ask(args, settings: Settings) -> int:
    question = (args.question or "").strip()
    if not question:
        raise UsageError('The question is empty: deskeye ask "What does this error mean?"')
    routed = _route(question, settings)
    if routed.quick_answer is not None:
        return _print_quick(routed.quick_answer, as_json=args.json)
    answer = _ask_once(settings, question, _frame(args, settings))
    _print_answer(answer, as_json=args.json, tier=routed.tier)
    return 0


def _route(question: str, settings: Settings):
    from deskeye.ask.asking import route_question
    from deskeye.ask.providers import QuickAnswerer
    from deskeye.ask.router import Router
    return route_question(question, Router.load(settings), QuickAnswerer(settings))


def _frame(args, settings: Settings) -> FramePng:
    """The image file (no window facts), else a grab of the region (--region, else the configured one) and the
    windows in it, unless private. Read now, before any worker starts; made PNG once the worker's limits are known."""
    if getattr(args, "image", None) is not None:
        path = Path(args.image).expanduser()
        rgb = read_image(path)
        return lambda limits: (image_png(rgb, path, limits.max_pixels_per_frame), ())
    png, windows = _grab_png(args, settings)
    return lambda limits: (png, windows)


def _grab_png(args, settings: Settings) -> tuple[bytes, tuple]:
    """The session's windows decide first (deskeye/see/window_list.py): where the desktop hides them, the exclusions
    that cannot be enforced are named on stderr before anything else; an excluded active window is refused before
    the region is even read, an excluded window in the region before the grab."""
    from deskeye.see.capture import ScreenGrabber
    from deskeye.see.privacy import active_window, check_privacy
    from deskeye.see.window_list import SessionWindows
    windows = SessionWindows()
    windows.say_titles_unknown(settings.excluded_titles)
    grabber = ScreenGrabber.for_settings(settings, getattr(args, "region", None))
    try:
        seen = windows.read()
        active = seen.active or active_window()
        verdict = check_privacy(settings.excluded_titles, active=active)     # needs no region: checked first
        if not verdict.is_excluded:
            rect = grabber.rect()
            verdict = check_privacy(settings.excluded_titles, region=grabber.privacy_region(), windows=seen.windows,
                                    active=active)
        if verdict.is_excluded:
            raise PrivacyRefusal(verdict.reason)
        print(LOOKING_AT.format(width=rect.width, height=rect.height, left=rect.left, top=rect.top,
                                monitor=settings.capture.monitor), file=sys.stderr)
        frame = grabber.grab()
        return frame.png(), frame.windows
    finally:
        grabber.close_thread()
        windows.close_thread()


def load_image_png(path: Path, max_pixels: int = FALLBACK_LIMITS.max_pixels_per_frame) -> bytes:
    """Read an image file (any format PIL reads) and re-encode it as PNG, scaled down to `max_pixels` if larger;
    UsageError naming what is wrong."""
    path = Path(path).expanduser()
    return image_png(read_image(path, max_pixels), path, max_pixels)


def read_image(path: Path, max_pixels: int = FALLBACK_LIMITS.max_pixels_per_frame) -> "Image.Image":
    """An image file (any format PIL reads) as RGB, decoded no larger than needed for `max_pixels` where the format
    allows (JPEG); UsageError naming what is wrong."""
    from PIL import Image, UnidentifiedImageError

    path = Path(path).expanduser()
    try:
        with Image.open(path) as image:
            if image.width * image.height > max_pixels:
                image.draft("RGB", _fit(image.size, max_pixels))      # JPEG decodes smaller at once
            image.load()
            rgb = image.convert("RGB")
    except FileNotFoundError:
        raise UsageError(f"--image {path}: no such file.") from None
    except IsADirectoryError:
        raise UsageError(f"--image {path}: is a folder, not an image file.") from None
    except PermissionError:
        raise UsageError(f"--image {path}: permission denied.") from None
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, SyntaxError) as exc:
        raise UsageError(f"--image {path}: not an image DeskEye can read (PNG, JPEG, WebP, BMP, GIF): "
                         f"{exc}") from None
    return rgb


def image_png(rgb: "Image.Image", path: Path, max_pixels: int) -> bytes:
    """`rgb` as PNG, scaled down to `max_pixels` if larger (saying so on stderr, naming the file at `path`)."""
    from PIL import Image

    if rgb.width * rgb.height > max_pixels:
        size = _fit(rgb.size, max_pixels)
        print(f"deskeye: {path} is {rgb.width}x{rgb.height}; sending it scaled down to {size[0]}x{size[1]}.",
              file=sys.stderr)
        rgb = rgb.resize(size, Image.Resampling.LANCZOS)
    buffer = io.BytesIO()
    rgb.save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


def _fit(size: tuple[int, int], max_pixels: int) -> tuple[int, int]:
    scale = (max_pixels / (size[0] * size[1])) ** 0.5
    return max(1, int(size[0] * scale)), max(1, int(size[1] * scale))


def _ask_once(settings: Settings, question: str, frame: FramePng) -> Answer:
    supervisor = WorkerSupervisor(settings)
    if not supervisor.is_external:
        print(f"deskeye: starting the worker (engine {settings.worker.engine}"
              f"{', model ' + settings.worker.model if settings.worker.model else ''}) ...", file=sys.stderr)
    client = WorkerClient(supervisor, settings)
    try:
        supervisor.start()
        png, windows = frame(client.limits())
        return client.ask(question, png, windows=windows)
    finally:
        client.close()
        supervisor.stop()


def _print_quick(quick, *, as_json: bool) -> int:
    if as_json:
        print(json.dumps({"summary": quick.text, "key_objects": [], "engine": f"quick:{quick.provider}",
                          "latency_ms": round(quick.elapsed_ms), "tier": "quick"}, ensure_ascii=False))
    else:
        print(printable(quick.text))
    return 1 if quick.is_error else 0


def _print_answer(answer: Answer, *, as_json: bool, tier: str | None = None) -> None:
    if as_json:
        print(json.dumps({**answer.to_dict(), **({"tier": tier} if tier else {})}))
        return
    print(printable(answer.summary))
    for name in answer.key_objects:
        print(f"  - {printable(name)}")
    print(f"({printable(answer.engine)}, {answer.latency_ms} ms)")
    for note in answer.notes:                       # e.g. the question was cut to what DeskEye sends
        print(f"deskeye: {printable(note)}", file=sys.stderr)
