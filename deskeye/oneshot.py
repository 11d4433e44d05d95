"""`deskeye describe` and `deskeye ask`: one frame (the screen or an image file), one answer, then exit.

stdout carries only the answer (with --json exactly one object: summary, key_objects, engine, latency_ms,
output_mode; `ask` adds `tier`); progress and errors go to stderr. `ask` routes like the Ask box: a quick question
is answered by a local provider without starting the worker. A screen grab honours the privacy exclusions with the
app's own message (the active window, and any excluded window in the region).
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

from deskeye.client import Answer, WorkerClient, printable
from deskeye.errors import DeskEyeError, UsageError
from deskeye.prompt import DESCRIBE_QUESTION
from deskeye.settings import Settings, with_overrides
from deskeye.supervisor import WorkerSupervisor

# The worker's default limit (inference_worker.config.DEFAULT_MAX_IMAGE_PIXELS; tests/test_oneshot_cli.py checks
# they agree). A larger image file is scaled down to it before it is sent.
MAX_IMAGE_PIXELS = 7680 * 4320


class PrivacyRefusal(DeskEyeError):
    """An excluded window is active or in the region: nothing was captured."""
    exit_code = 3


def cmd_describe(args, settings: Settings) -> int:
    settings = _apply_overrides(args, settings)
    png, windows = _frame_png(args, settings)
    answer = _ask_once(settings, DESCRIBE_QUESTION, png, windows)
    _print_answer(answer, as_json=args.json)
    return 0


def cmd_ask(args, settings: Settings) -> int:
    question = (args.question or "").strip()
    if not question:
        raise UsageError('The question is empty: deskeye ask "What does this error mean?"')
    settings = _apply_overrides(args, settings)
    routed = _route(question, settings)
    if routed.quick_answer is not None:
        return _print_quick(routed.quick_answer, as_json=args.json)
    png, windows = _frame_png(args, settings)
    answer = _ask_once(settings, question, png, windows)
    _print_answer(answer, as_json=args.json, tier=routed.tier)
    return 0


def _route(question: str, settings: Settings):
    from deskeye.asking import route_question
    from deskeye.providers import QuickAnswerer
    from deskeye.router import Router
    return route_question(question, Router.load(settings), QuickAnswerer(settings))


def _apply_overrides(args, settings: Settings) -> Settings:
    from deskeye.app import worker_overrides
    overrides = worker_overrides(args)
    return with_overrides(settings, worker=overrides) if overrides else settings


def _frame_png(args, settings: Settings) -> tuple[bytes, tuple]:
    """The image file as PNG (no window facts), else a grab of the region (--region, else the configured one) and
    the windows in it, unless private."""
    if getattr(args, "image", None) is not None:
        return load_image_png(args.image), ()
    from deskeye.capture import ScreenGrabber
    from deskeye.privacy import check_privacy
    from deskeye.x11_windows import OwnWindows
    grabber, windows = ScreenGrabber(settings.capture, getattr(args, "region", None)), OwnWindows()
    try:
        verdict = check_privacy(settings.excluded_titles, region=grabber.rect(), windows=windows.windows())
        if verdict.is_excluded:
            raise PrivacyRefusal(verdict.reason)
        frame = grabber.grab()
        return frame.png(), frame.windows
    finally:
        grabber.close_thread()
        windows.close_thread()


def load_image_png(path: Path, max_pixels: int = MAX_IMAGE_PIXELS) -> bytes:
    """Read an image file (any format PIL reads) and re-encode it as PNG, scaled down to `max_pixels` if larger;
    UsageError naming what is wrong."""
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


def _ask_once(settings: Settings, question: str, png: bytes, windows: tuple = ()) -> Answer:
    supervisor = WorkerSupervisor(settings)
    if not supervisor.is_external:
        print(f"deskeye: starting the worker (engine {settings.worker.engine}"
              f"{', model ' + settings.worker.model if settings.worker.model else ''}) ...", file=sys.stderr)
    client = WorkerClient(supervisor, settings)
    try:
        supervisor.start()
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
