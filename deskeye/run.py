"""`deskeye run`: build the desktop app, run it until Quit (tray), Ctrl+C or SIGTERM, and leave nothing behind.

SIGTERM/SIGINT count from the first line, whatever start-up is doing; a second one while stopping ends the process at
once. Whatever ends the run (those, an exception, the X server going away), the worker is stopped and the run folder,
with every temporary file of the run, is removed (deskeye/lifecycle.py).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path

from deskeye.app import JOIN_TIMEOUT_S, App
from deskeye.compose import build_app
from deskeye.errors import DeskEyeError
from deskeye.language import N_, _
from deskeye.lifecycle import (EXIT_DISPLAY_LOST, EXIT_STUCK, RunFolder, StopSignals, exit_now, on_display_lost,
                               write_stderr)
from deskeye.settings import Settings, default_settings_path
from deskeye.ui.notify import Notifier

log = logging.getLogger(__name__)

CANNOT_START = N_("DeskEye cannot start")
DISPLAY_LOST_WAIT_S = 2.0        # the X server went away: this long for the rest of a clean stop (the threads that
                                 # draw are stuck on the dead display; the worker is stopped before)
_display_gone = threading.Event()


def cmd_run(args, settings: Settings) -> int:
    """`deskeye run [--region X,Y,W,H] [--engine E] [--model M]` (the worker options are already in `settings`)."""
    with StopSignals() as signals, RunFolder() as folder:
        path = Path(args.settings) if getattr(args, "settings", None) else default_settings_path()
        app = build_app(settings, region=args.region, settings_path=path, use_trigger=True, temp_root=folder.path)
        signals.on_stop(app.quit)              # at once, if a signal came while building
        on_display_lost(lambda: _display_lost(app))
        threading.excepthook = _quiet_x_connection_errors
        try:
            try:
                app.start()
            except DeskEyeError as exc:        # started from a menu, nobody reads stderr: say it on the desktop too
                Notifier().notify(_(CANNOT_START), str(exc))
                raise
            if not app.is_stopping:
                print(app.ready_line(), file=sys.stderr, flush=True)
            app.wait()
        finally:
            app.quit()
            _wait_until_stopped(app)
    return 0


def _wait_until_stopped(app: App) -> None:
    """Every part stopped; else (threads stuck on a frozen X server would keep the process alive) end it now."""
    if not app.wait(JOIN_TIMEOUT_S * 2):
        exit_now(EXIT_STUCK, f"did not stop within {JOIN_TIMEOUT_S * 2:.0f} s; stopping now.")
    stuck = app.stuck_threads()
    if stuck:
        exit_now(EXIT_STUCK, f"stopped, but {', '.join(stuck)} never finished (is the X server frozen?); "
                             "exiting without them.")


def _display_lost(app: App) -> None:
    """Called by Xlib's IO-error handler on the thread that found the X server gone; ends the process."""
    _display_gone.set()
    write_stderr(f"deskeye: lost the X display {os.environ.get('DISPLAY', '')} (the X server stopped or the session "
                 "ended); stopping.\n")
    app.quit()
    app.stop_workers()                         # first: the threads that draw are stuck on the dead display
    app.wait(DISPLAY_LOST_WAIT_S)
    exit_now(EXIT_DISPLAY_LOST)


def _quiet_x_connection_errors(args) -> None:
    """A thread that talks to the X server on its own connection (pynput's hotkey listener) dies when the server
    closes it, often before Xlib's IO-error handler has run on another thread: one line, never a traceback."""
    if isinstance(args.exc_value, _xlib_connection_errors()) or (
            _display_gone.is_set() and isinstance(args.exc_value, OSError)):
        name = args.thread.name if args.thread else "a thread"
        if _display_gone.is_set():
            log.debug("%s ended: %s", name, args.exc_value)
        else:
            log.warning("deskeye: %s stopped: the X server closed its connection (%s).", name, args.exc_value)
        return
    threading.__excepthook__(args)


def _xlib_connection_errors() -> tuple[type, ...]:
    try:
        from Xlib.error import ConnectionClosedError
    except ImportError:
        return ()
    return (ConnectionClosedError,)
