"""`deskeye` command line: parses argv (only inside main) and hands a Settings object to the feature, with the
command's `--engine` / `--model` already in its [worker] settings.

Each subcommand lives in the module that owns its concept; this file only wires them up.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from deskeye.errors import DeskEyeError, UsageError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deskeye",
        description="A private desktop assistant that looks at a region of the screen and tells you what is there.",
    )
    parser.add_argument("--settings", type=Path, default=None,
                        help="settings TOML file (default: the platform config dir, deskeye/settings.toml)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="start the tray app: capture loop, hotkeys, overlay")
    p.add_argument("--region", help="X,Y,W,H screen region to watch (default: 800x600 centred)")
    _add_worker_options(p)
    p.set_defaults(handler="deskeye.run:cmd_run")

    p = sub.add_parser("describe", help="describe the screen (or an image) once and print the answer")
    _add_source(p, image_help="describe this image file instead of the screen")
    p.add_argument("--json", action="store_true",
                   help='print exactly {"summary", "key_objects", "engine", "latency_ms"}')
    _add_worker_options(p)
    p.set_defaults(handler="deskeye.oneshot:cmd_describe")

    p = sub.add_parser("ask", help="ask a question, routed like the Ask box (quick answers need no worker)")
    p.add_argument("question")
    _add_source(p, image_help="ask about this image file instead of the screen")
    p.add_argument("--json", action="store_true", help='print the answer as JSON (describe\'s keys plus "tier")')
    _add_worker_options(p)
    p.set_defaults(handler="deskeye.oneshot:cmd_ask")

    p = sub.add_parser("trigger", help="make the running app describe, open the Ask box, pause or resume "
                                       "(bind it to a key in your desktop's keyboard settings)")
    from deskeye.ui.trigger import ACTIONS      # cheap: sockets and words, no GUI toolkit
    p.add_argument("action", choices=ACTIONS)
    p.set_defaults(handler="deskeye.ui.trigger:cmd_trigger")

    p = sub.add_parser("doctor", help="check display, capture, hotkeys, GPU, model and worker; one line each")
    p.set_defaults(handler="deskeye.doctor:cmd_doctor")

    p = sub.add_parser("settings", help="show the settings file path, or write a documented default one")
    p.add_argument("--init", action="store_true", help="write the documented defaults if no file exists")
    p.set_defaults(handler="deskeye.settings_cli:cmd_settings")

    p = sub.add_parser("route", help="show which tier (quick/standard/deep) a query goes to")
    p.add_argument("queries", nargs="*", metavar="QUERY")
    p.add_argument("--json", action="store_true", help='one JSON line per query: {"query", "tier", "confidence"}')
    p.add_argument("--evaluate", action="store_true", help="print cross-validated accuracy per tier")
    p.set_defaults(handler="deskeye.ask.router:cmd_route")

    p = sub.add_parser("hooks", help="validate or fire automation hooks")
    hooks = p.add_subparsers(dest="hooks_command", required=True, metavar="ACTION")
    h = hooks.add_parser("check", help="validate hook rules")
    _add_rules_option(h)
    h.set_defaults(handler="deskeye.hooks.cli:cmd_check")
    h = hooks.add_parser("fire", help="run the hooks matching these key_objects once, as the app would")
    _add_rules_option(h)
    h.add_argument("--key-objects", required=True, help='JSON list of strings, e.g. \'["inbox", "3 unread"]\'')
    h.add_argument("--summary", default="", help="the description's summary text")
    h.add_argument("--dry-run", action="store_true", help="print what would run; run nothing")
    h.set_defaults(handler="deskeye.hooks.cli:cmd_fire")
    return parser


def _add_worker_options(p: argparse.ArgumentParser) -> None:
    """The worker the command starts, when it needs one (run, describe, ask)."""
    p.add_argument("--engine", choices=["auto", "ocr", "transformers", "openvino"], help="worker engine (default: settings)")
    p.add_argument("--model", help="vision-language model folder or Hugging Face id (default: settings)")


def _add_source(p: argparse.ArgumentParser, *, image_help: str) -> None:
    """What a one-shot command looks at: an image file or a screen region, not both."""
    src = p.add_mutually_exclusive_group()
    src.add_argument("--image", type=Path, help=image_help)
    src.add_argument("--region", help="X,Y,W,H screen region (default: settings)")


def _add_rules_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rules", type=Path, help="hooks TOML file (default: DeskEye's deskeye/rules/hooks.toml and the user's file)")


def _resolve(handler: str):
    import importlib
    module, name = handler.split(":")
    return getattr(importlib.import_module(module), name)


VALUE_OPTIONS = ("--region",)       # options whose value may start with '-' (a negative X: a clear error later)


def join_option_values(argv: list[str]) -> list[str]:
    """`--region -5,0,100,100` -> `--region=-5,0,100,100`, so argparse does not take the value for an option
    and the region check can say what is wrong with it."""
    joined, i = [], 0
    while i < len(argv):
        if argv[i] in VALUE_OPTIONS and i + 1 < len(argv) and argv[i + 1].startswith("-") and argv[i + 1][1:2].isdigit():
            joined.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            joined.append(argv[i])
            i += 1
    return joined


def worker_overrides(args) -> dict[str, str]:
    """--engine / --model as [worker] settings. `--model` alone means that model or a clear failure (never a
    silent fall back to OCR), and a model path that does not exist is refused here, in one line."""
    engine, model = getattr(args, "engine", None), getattr(args, "model", None)
    overrides = {k: v for k, v in (("engine", engine), ("model", model)) if v}
    if model:
        if model.startswith(("/", "./", "../", "~")) and not Path(model).expanduser().exists():
            raise UsageError(f"--model {model}: no such folder. Give a model folder or a Hugging Face id "
                             "(e.g. openbmb/MiniCPM-V-4.6), or leave --model out to use the OCR engine.")
        if not engine:
            overrides["engine"] = "transformers"
    return overrides


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(join_option_values(sys.argv[1:] if argv is None else list(argv)))
    from deskeye.lifecycle import Terminated, interrupt_on_signals
    try:
        with interrupt_on_signals():     # SIGTERM unwinds like Ctrl+C: a worker started for one answer is stopped
            from deskeye.language import use_language
            from deskeye.settings import load_settings, with_overrides
            settings = load_settings(args.settings)
            use_language(settings.ui.language)      # the words of every command, and the language answers are asked in
            worker = worker_overrides(args)
            if worker:
                settings = with_overrides(settings, worker=worker)
            return int(_resolve(args.handler)(args, settings) or 0)
    except DeskEyeError as exc:
        print(f"deskeye: {exc}", file=sys.stderr)
        return exc.exit_code
    except Terminated as exc:
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:             # `deskeye settings | head -1`: the reader left; not an error of ours
        _silence_stdout()
        return 0


def _silence_stdout() -> None:
    """After a broken pipe, point stdout at /dev/null so the interpreter's final flush does not complain."""
    import os
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
