"""`deskeye` command line: parses argv (only inside main) and hands a Settings object to the feature.

Each subcommand lives in the module that owns its concept; this file only wires them up.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from deskeye.errors import DeskEyeError


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
    p.add_argument("--engine", choices=["auto", "ocr", "transformers", "openvino"], help="worker engine (default: settings)")
    p.add_argument("--model", help="vision-language model folder or Hugging Face id (default: settings)")
    p.set_defaults(handler="deskeye.app:cmd_run")

    p = sub.add_parser("describe", help="describe the screen (or an image) once and print the answer")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--image", type=Path, help="describe this image file instead of the screen")
    src.add_argument("--region", help="X,Y,W,H screen region (default: settings)")
    p.add_argument("--json", action="store_true",
                   help='print exactly {"summary", "key_objects", "engine", "latency_ms"}')
    p.add_argument("--engine", choices=["auto", "ocr", "transformers", "openvino"], help="worker engine (default: settings)")
    p.add_argument("--model", help="vision-language model folder or Hugging Face id (default: settings)")
    p.set_defaults(handler="deskeye.oneshot:cmd_describe")

    p = sub.add_parser("ask", help="ask a question, routed like the Ask box (quick answers need no worker)")
    p.add_argument("question")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--image", type=Path, help="ask about this image file instead of the screen")
    src.add_argument("--region", help="X,Y,W,H screen region (default: settings)")
    p.add_argument("--json", action="store_true", help='print the answer as JSON (describe\'s keys plus "tier")')
    p.add_argument("--engine", choices=["auto", "ocr", "transformers", "openvino"], help="worker engine (default: settings)")
    p.add_argument("--model", help="vision-language model folder or Hugging Face id (default: settings)")
    p.set_defaults(handler="deskeye.oneshot:cmd_ask")

    p = sub.add_parser("doctor", help="check display, capture, GPU, model and worker; one line each")
    p.set_defaults(handler="deskeye.doctor:cmd_doctor")

    p = sub.add_parser("settings", help="show the settings file path, or write a documented default one")
    p.add_argument("--init", action="store_true", help="write the documented defaults if no file exists")
    p.set_defaults(handler="deskeye.settings_cli:cmd_settings")

    p = sub.add_parser("route", help="show which tier (quick/standard/deep) a query goes to")
    p.add_argument("queries", nargs="*", metavar="QUERY")
    p.add_argument("--json", action="store_true", help='one JSON line per query: {"query", "tier", "confidence"}')
    p.add_argument("--evaluate", action="store_true", help="print cross-validated accuracy per tier")
    p.set_defaults(handler="deskeye.router:cmd_route")

    p = sub.add_parser("hooks", help="validate or fire automation hooks")
    hooks = p.add_subparsers(dest="hooks_command", required=True, metavar="ACTION")
    h = hooks.add_parser("check", help="validate hook rules")
    h.add_argument("--rules", type=Path, help="hooks TOML file (default: DeskEye's deskeye/rules/hooks.toml and the user's file)")
    h.set_defaults(handler="deskeye.hooks:cmd_check")
    h = hooks.add_parser("fire", help="run the hooks matching these key_objects once, as the app would")
    h.add_argument("--rules", type=Path, help="hooks TOML file (default: DeskEye's deskeye/rules/hooks.toml and the user's file)")
    h.add_argument("--key-objects", required=True, help='JSON list of strings, e.g. \'["inbox", "3 unread"]\'')
    h.add_argument("--summary", default="", help="the description's summary text")
    h.add_argument("--dry-run", action="store_true", help="print what would run; run nothing")
    h.set_defaults(handler="deskeye.hooks:cmd_fire")
    return parser


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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(join_option_values(sys.argv[1:] if argv is None else list(argv)))
    from deskeye.lifecycle import Terminated, interrupt_on_signals
    try:
        with interrupt_on_signals():     # SIGTERM unwinds like Ctrl+C: a worker started for one answer is stopped
            from deskeye.settings import load_settings
            settings = load_settings(args.settings)
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
