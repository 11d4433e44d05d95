"""How a `deskeye` process ends, whatever ends it, without leaving a worker or a temporary folder behind.

- `RunFolder`: the run's private temporary folder (`deskeye-run-*`). The worker's state folder, the tray's icons and
  the settings in effect (deskeye/live_settings.py) go inside it, so one removal on the way out takes them all,
  even when a stuck thread never gets to its own.
- `StopSignals` (`deskeye run`): SIGTERM, SIGINT and SIGHUP from the command's first line. The C-level handler only
  writes the signal's number to the interpreter's wakeup fd; the thread `deskeye-signals` reads it and asks for a
  clean stop (`on_stop`), once: a stop is never undone. A Python-level handler would run inside the main thread
  wherever it was, so it could deadlock on a lock the interrupted code holds. A second signal while stopping means
  "now": `exit_now`.
- `interrupt_on_signals` (one-shot commands): SIGTERM and SIGHUP unwind like Ctrl+C (`Terminated`), so `finally`
  blocks stop the worker; a second signal while unwinding: `exit_now`.
- `on_display_lost`: when the X server goes away, Xlib's default IO-error handler calls exit() (GTK's, _exit()):
  no `finally` runs and the folders stay. DeskEye's handler is called instead; it stops the app and ends the process.
- `run_folders`: the run folders of this user's runs, where `deskeye settings` finds a running app's state.
- `exit_now`: SIGKILL the workers this process started, remove its temporary folders, os._exit. For when a clean
  stop cannot finish: a second signal, threads stuck on a lost or frozen X server.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import stat
import sys
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Callable, Iterator, NoReturn

log = logging.getLogger(__name__)

RUN_FOLDER_PREFIX = "deskeye-run-"
EXIT_DISPLAY_LOST = 1
EXIT_STUCK = 1                   # stopped, but a thread never finished (a frozen X server): ended without it

_folders: list[Path] = []                        # run folders that exit_now removes
_killables: "weakref.WeakSet" = weakref.WeakSet()   # objects with kill() (worker supervisors) that exit_now calls


# ---------------------------------------------------------------------- ending now


def kill_on_exit_now(owner) -> None:
    """`exit_now` will call `owner.kill()` (SIGKILL its processes, remove its folder; it must take no lock)."""
    _killables.add(owner)


def exit_now(code: int, message: str = "") -> NoReturn:
    """End the process at once: SIGKILL every worker it started, remove its temporary folders, os._exit(code).

    Takes no lock and writes with os.write: the thread holding a lock may be the stuck one, or the one a signal
    interrupted."""
    if message:
        write_stderr(f"deskeye: {message}\n")
    for owner in list(_killables):
        try:
            owner.kill()
        except Exception:                # ending anyway: the rest must still be cleaned up
            pass
    for folder in list(_folders):
        shutil.rmtree(folder, ignore_errors=True)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def write_stderr(text: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, text.encode("utf-8", errors="replace"))


# ---------------------------------------------------------------------- the run's folder


class RunFolder:
    """A private (0700) folder in the system temp folder for one run's temporary files. Removed when the `with`
    block ends, however it ends, and by `exit_now`."""

    def __init__(self, prefix: str = RUN_FOLDER_PREFIX):
        self.path = Path(tempfile.mkdtemp(prefix=prefix))
        _folders.append(self.path)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        with contextlib.suppress(ValueError):
            _folders.remove(self.path)

    def __enter__(self) -> "RunFolder":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def run_folders() -> list[Path]:
    """This user's run folders in the system temp folder: those of the runs going on (and of a run that was killed
    before it could remove its own). Another user's, or a symlink by that name, is not listed."""
    uid = os.getuid()
    folders = []
    for path in Path(tempfile.gettempdir()).glob(f"{RUN_FOLDER_PREFIX}*"):
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode) and info.st_uid == uid:
            folders.append(path)
    return folders


# ---------------------------------------------------------------------- signals


def _stop_signals() -> list[signal.Signals]:
    """SIGTERM and SIGINT; SIGHUP too unless it is ignored (`nohup deskeye run` must keep running)."""
    signals = [signal.SIGTERM, signal.SIGINT]
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signals.append(signal.SIGHUP)
    return signals


def _only_wake(signum, frame) -> None:
    """The Python-level handler of StopSignals: nothing; the wakeup fd carries the signal to `deskeye-signals`."""


class StopSignals:
    """SIGTERM, SIGINT and SIGHUP for a long-running command, from the moment this is made (before anything slow).

    The first signal calls `on_stop`'s callback once, on the thread `deskeye-signals` (at registration if the signal
    came first); a later one ends the process with `exit_now`. Use it as a context manager (main thread only): the
    previous handlers come back at the end."""

    def __init__(self):
        self._lock = threading.Lock()
        self._on_stop: Callable[[], None] | None = None
        self._signum = 0                         # the first signal received; 0 = none yet
        self._signals = _stop_signals()
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)   # the C handler must never block
        self._previous_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        self._previous = {signum: signal.signal(signum, _only_wake) for signum in self._signals}
        self._thread = threading.Thread(target=self._watch, name="deskeye-signals", daemon=True)
        self._thread.start()

    def on_stop(self, callback: Callable[[], None]) -> None:
        """Call `callback` on the first signal; now, if one came already."""
        with self._lock:
            self._on_stop = callback
            pending = self._signum != 0
        if pending:
            callback()

    def close(self) -> None:
        """Restore the previous handlers and wakeup fd; end the watching thread."""
        signal.set_wakeup_fd(self._previous_fd)
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        os.close(self._write_fd)                  # the thread reads EOF and ends
        self._thread.join(1.0)
        os.close(self._read_fd)

    def __enter__(self) -> "StopSignals":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _watch(self) -> None:
        while True:
            try:
                received = os.read(self._read_fd, 64)
            except OSError:
                return
            if not received:
                return
            for signum in received:
                if signum in self._signals:
                    self._received(signal.Signals(signum))

    def _received(self, signum: signal.Signals) -> None:
        with self._lock:
            first = self._signum == 0
            if first:
                self._signum = signum
            callback = self._on_stop
        if not first:
            exit_now(128 + signum, f"{signum.name} again while stopping: stopping now.")
        log.info("%s: stopping", signum.name)
        if callback is not None:
            try:
                callback()
            except Exception:                # this thread must live on: a second signal still ends the process
                log.exception("stopping on %s failed", signum.name)


class Terminated(KeyboardInterrupt):
    """A stop signal in a one-shot command: it unwinds like Ctrl+C, so `finally` blocks stop what was started."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


@contextlib.contextmanager
def interrupt_on_signals() -> Iterator[None]:
    """For a one-shot command: the first SIGTERM, SIGINT or SIGHUP raises `Terminated` in the main thread; another
    one while it unwinds ends the process now (`exit_now`). The previous handlers come back at the end. Outside
    the main thread (signals cannot be handled there) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised = []

    def handler(signum, frame):
        if raised:
            exit_now(128 + signum, f"{signal.Signals(signum).name} again while stopping: stopping now.")
        raised.append(signum)
        raise Terminated(signum)

    previous = {signum: signal.signal(signum, handler) for signum in _stop_signals()}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


# ---------------------------------------------------------------------- the X server going away

_IO_ERROR_HANDLER = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
_display = {"handler": None, "xlib": None}   # the installed handler (kept alive: Xlib holds a bare pointer to it)


def on_display_lost(callback: Callable[[], None]) -> bool:
    """From now on, when Xlib finds the X server gone (an IO error on any connection of this process: Tk's, GTK's,
    the screen grabber's), call `callback` on the thread that found it, instead of Xlib's exit(). The callback
    should end the process (it gets `exit_now` after it if it returns); threads that find it gone as well wait.
    Returns False where there is no libX11 (nothing to watch)."""
    xlib = _libx11()
    if xlib is None:
        return False
    claimed = threading.Lock()

    def handler(_display_ptr) -> int:
        if not claimed.acquire(blocking=False):     # another thread is ending the process
            threading.Event().wait()                # never return: Xlib would call exit()
        try:
            callback()
        finally:
            exit_now(EXIT_DISPLAY_LOST)
        return 0

    _display["handler"] = _IO_ERROR_HANDLER(handler)
    xlib.XSetIOErrorHandler(_display["handler"])
    return True


def reassert_display_handler() -> None:
    """Put DeskEye's IO-error handler back after a library replaced it (GTK sets one that _exit()s at import)."""
    if _display["handler"] is not None and _display["xlib"] is not None:
        _display["xlib"].XSetIOErrorHandler(_display["handler"])


def _libx11():
    if _display["xlib"] is not None:
        return _display["xlib"]
    if not sys.platform.startswith("linux"):
        return None
    try:
        xlib = ctypes.CDLL("libX11.so.6")          # the one Tk, GTK and mss use: its handler is per process
    except OSError:
        return None
    xlib.XSetIOErrorHandler.restype = ctypes.c_void_p
    xlib.XSetIOErrorHandler.argtypes = [_IO_ERROR_HANDLER]
    _display["xlib"] = xlib
    return xlib
