"""`deskeye-worker`: start the inference worker. Parses argv only inside `main`.

Every WorkerConfig field has a flag, made from the field (its argparse `dest` is the field name; config.py holds
its name, default and help). Errors are one line on stderr and a non-zero exit status, never a traceback: 2 for
bad options, 1 when the worker cannot start.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import threading

from inference_worker.config import API_KEY_ENV, ConfigError, WorkerConfig, flag_name

PROG = "deskeye-worker"


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """One flag per WorkerConfig field, made from the field's default and its metadata (config.option), in
    sections in the order the fields are declared; then --verbose, which is the CLI's own."""
    p = _OneLineParser(
        prog=PROG,
        description="DeskEye's inference worker: an OpenAI-compatible HTTP server (POST /v1/chat/completions, "
                    "GET /v1/models, GET /health, GET /metrics) that owns the model. It listens on 127.0.0.1, "
                    "requires 'Authorization: Bearer KEY' (except /health), and writes its URL and key to a "
                    "state file readable only by you.",
    )
    sections: dict[str, argparse._ArgumentGroup] = {}
    for config_field in dataclasses.fields(WorkerConfig):
        flag = config_field.metadata["flag"]
        if flag.section not in sections:
            sections[flag.section] = p.add_argument_group(flag.section)
        _add_flag(sections[flag.section], config_field)
    p.add_argument("--verbose", action="store_true",
                   help="log every request and rejected output, and show tracebacks of engine errors")
    return p


def _add_flag(section: argparse._ArgumentGroup, config_field: dataclasses.Field) -> None:
    """A bool field is a switch that flips its default; any other field takes a value."""
    flag, default = config_field.metadata["flag"], config_field.default
    name = flag_name(config_field.name)
    if isinstance(default, bool):
        section.add_argument(name, dest=config_field.name, action="store_false" if default else "store_true",
                             help=flag.help)
        return
    parse = flag.parse or (type(default) if type(default) in (int, float) else None)
    section.add_argument(name, dest=config_field.name, type=parse, default=default, metavar=flag.metavar,
                         choices=flag.choices, help=flag.help)


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    values = {k: v for k, v in vars(args).items() if k != "verbose"}
    if values["api_key"] is None:
        values["api_key"] = os.environ.get(API_KEY_ENV) or None
    return WorkerConfig(**values)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _configure_logging(args.verbose)
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        return _fail(str(exc), 2)
    return _run(config)


def _run(config: WorkerConfig) -> int:
    from inference_worker.server.auth import StateFileError
    from inference_worker.server.lifetime import WorkerStartError, run_worker

    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    try:
        run_worker(config, stop)
    except (WorkerStartError, StateFileError) as exc:
        return _fail(str(exc), 1)
    return 0


def _fail(message: str, status: int) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return status


def _configure_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr,
                        format=f"{PROG}: %(levelname)s: %(message)s")
    logging.getLogger("inference_worker").setLevel(logging.DEBUG if verbose else logging.INFO)


if __name__ == "__main__":
    sys.exit(main())
