"""Commands from any thread to the one thread that owns Tk, which sleeps until one comes.

Other threads never touch Tk: they `post` a function, which is queued and a byte written to a pipe; Tk watches the
pipe's read end (`createfilehandler`) and runs what is queued as soon as it can be read. An idle overlay thus wakes
for nothing: polling the queue every 50 ms cost an idle app about half a percent of a core. Where Tk cannot watch a
file (Tk on Windows), it falls back to polling every `FALLBACK_POLL_MS`.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from typing import Callable

log = logging.getLogger(__name__)

FALLBACK_POLL_MS = 50
MAX_WAKE_BYTES = 4096


class TkCommands:
    """`post(fn)` from any thread; `attach(root, on_stop)` once on the Tk thread, `detach()` at its end."""

    def __init__(self):
        self._queue: queue.Queue[Callable[[], None]] = queue.Queue()
        self._lock = threading.Lock()          # guards the pipe's write end against `detach` closing it
        self._wake_r: int | None = None
        self._wake_w: int | None = None
        self._stopping = threading.Event()
        self._root = None
        self._on_stop: Callable[[], None] = lambda: None

    def post(self, fn: Callable[[], None]) -> None:
        self._queue.put(fn)
        self._wake()

    def stop(self) -> None:
        """Ask the Tk thread to call `on_stop` (it destroys Tk, which ends its main loop)."""
        self._stopping.set()
        self._wake()

    def attach(self, root, on_stop: Callable[[], None]) -> None:
        """Start serving commands on this (the Tk) thread: at once, then whenever one is posted."""
        import tkinter
        self._root, self._on_stop = root, on_stop
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        try:
            root.tk.createfilehandler(wake_r, tkinter.READABLE, lambda fd, mask: self._run_queued())
        except (AttributeError, tkinter.TclError):          # no file handlers here: poll instead
            os.close(wake_r)
            os.close(wake_w)
            root.after(FALLBACK_POLL_MS, self._poll)
            return
        with self._lock:
            self._wake_r, self._wake_w = wake_r, wake_w
        root.after_idle(self._run_queued)                    # what was posted before the pipe existed

    def detach(self) -> None:
        with self._lock:
            wake_r, wake_w = self._wake_r, self._wake_w
            self._wake_r = self._wake_w = None
        if wake_r is not None:
            try:
                self._root.tk.deletefilehandler(wake_r)
            except Exception:                                 # Tk is already gone
                pass
            os.close(wake_r)
            os.close(wake_w)
        self._root, self._on_stop = None, lambda: None      # no Tk object may outlive its thread here

    def _wake(self) -> None:
        with self._lock:
            if self._wake_w is None:
                return
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:                           # the pipe is full: the Tk thread is awake anyway
                pass

    def _poll(self) -> None:
        if self._root is None:
            return
        self._run_queued()
        if self._root is not None and not self._stopping.is_set():
            self._root.after(FALLBACK_POLL_MS, self._poll)

    def _run_queued(self) -> None:
        with self._lock:
            wake_r = self._wake_r
        if wake_r is not None:
            try:
                while os.read(wake_r, MAX_WAKE_BYTES):
                    pass
            except BlockingIOError:
                pass
        if self._stopping.is_set():
            self._on_stop()
            return
        while True:
            try:
                command = self._queue.get_nowait()
            except queue.Empty:
                return
            try:
                command()
            except Exception:
                log.exception("Overlay command failed")
