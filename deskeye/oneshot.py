"""`deskeye describe` and `deskeye ask`: one frame (the screen or an image file), one answer, then exit.

stdout carries only the answer (with --json exactly one object: summary, key_objects, engine, latency_ms, output_mode);
progress and errors go to stderr. `ask` is a plain model question: routing to quick answers is the tray's.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

from deskeye.client import Answer, WorkerClient, printable
from deskeye.errors import UsageError
from deskeye.settings import Settings, with_overrides
from deskeye.supervisor import WorkerSupervisor
from inference_worker.protocol import DESCRIBE_QUESTION


def cmd_describe(args, settings: Settings) -> int:
    return _answer_once(args, settings, DESCRIBE_QUESTION)


def cmd_ask(args, settings: Settings) -> int:
    question = (args.question or "").strip()
    if not question:
        raise UsageError('The question is empty: deskeye ask "What does this error mean?"')
    return _answer_once(args, settings, question)


def _answer_once(args, settings: Settings, question: str) -> int:
    settings = _apply_overrides(args, settings)
    answer = _ask_once(settings, question, _frame_png(args, settings))
    _print_answer(answer, as_json=args.json)
    return 0


def _apply_overrides(args, settings: Settings) -> Settings:
    overrides = {key: value for key in ("engine", "model") if (value := getattr(args, key, None))}
    return with_overrides(settings, worker=overrides) if overrides else settings


def _frame_png(args, settings: Settings) -> bytes:
    """The image file as PNG, else a grab of the region (--region, else the configured one)."""
    if getattr(args, "image", None) is not None:
        return load_image_png(args.image)
    from deskeye.capture import grab_png
    return grab_png(settings, getattr(args, "region", None))


def load_image_png(path: Path) -> bytes:
    """Read an image file (any format PIL reads) and re-encode it as PNG; UsageError naming what is wrong."""
    from PIL import Image, UnidentifiedImageError

    path = Path(path).expanduser()
    try:
        with Image.open(path) as image:
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
    buffer = io.BytesIO()
    rgb.save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


def _ask_once(settings: Settings, question: str, png: bytes) -> Answer:
    supervisor = WorkerSupervisor(settings)
    if not supervisor.is_external:
        print(f"deskeye: starting the worker (engine {settings.worker.engine}"
              f"{', model ' + settings.worker.model if settings.worker.model else ''}) ...", file=sys.stderr)
    client = WorkerClient(supervisor, settings)
    try:
        supervisor.start()
        return client.ask(question, png)
    finally:
        client.close()
        supervisor.stop()


def _print_answer(answer: Answer, *, as_json: bool) -> None:
    if as_json:
        print(json.dumps(answer.to_dict()))
        return
    print(printable(answer.summary))
    for name in answer.key_objects:
        print(f"  - {printable(name)}")
    print(f"({printable(answer.engine)}, {answer.latency_ms} ms)")

