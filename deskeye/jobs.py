"""The app's work queue: describe and ask jobs, served one at a time, in order, by one thread.

What the user asks for (hotkey, tray) is never dropped and goes before automatic describes of a
changed screen; at most one automatic describe waits at a time (a newer frame replaces it).
"""

from __future__ import annotations

import enum
import itertools
import queue
import threading
from dataclasses import dataclass, field

from deskeye.see.capture import Frame


class JobKind(enum.StrEnum):
    DESCRIBE = "describe"
    ASK = "ask"


class Source(enum.StrEnum):
    AUTO = "auto"            # the capture loop saw a meaningful change
    HOTKEY = "hotkey"
    TRAY = "tray"            # the tray, the overlay's menu or the Ask box


DESCRIBE, ASK = JobKind.DESCRIBE, JobKind.ASK
AUTO, HOTKEY, TRAY = Source.AUTO, Source.HOTKEY, Source.TRAY
USER_PRIORITY, AUTO_PRIORITY = 0, 1


@dataclass(frozen=True)
class Job:
    kind: JobKind
    source: Source
    question: str = ""               # for ASK
    frame: Frame | None = None       # AUTO describes carry the frame that changed; others grab when served

    @property
    def is_user(self) -> bool:
        return self.source != AUTO


@dataclass(order=True)
class _Entry:
    priority: int
    seq: int
    job: Job | None = field(compare=False)     # None = stop


class JobQueue:
    def __init__(self):
        self._queue: queue.PriorityQueue[_Entry] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._auto_waiting: _Entry | None = None

    def put(self, job: Job) -> None:
        with self._lock:
            if not job.is_user:
                if self._auto_waiting is not None:
                    self._auto_waiting.job = job          # the newest changed frame replaces the waiting one
                    return
                entry = _Entry(AUTO_PRIORITY, next(self._seq), job)
                self._auto_waiting = entry
            else:
                entry = _Entry(USER_PRIORITY, next(self._seq), job)
            self._queue.put(entry)

    def put_stop(self) -> None:
        self._queue.put(_Entry(-1, next(self._seq), None))

    def get(self, timeout_s: float) -> Job | None:
        """The next job; None on timeout. Raises StopIteration after put_stop()."""
        try:
            entry = self._queue.get(timeout=timeout_s)
        except queue.Empty:
            return None
        with self._lock:
            if entry is self._auto_waiting:
                self._auto_waiting = None
        if entry.job is None:
            raise StopIteration
        return entry.job

    def drain(self) -> list[Job]:
        """Remove and return every waiting job (at quit)."""
        jobs = []
        while True:
            try:
                entry = self._queue.get_nowait()
            except queue.Empty:
                break
            if entry.job is not None:
                jobs.append(entry.job)
        with self._lock:
            self._auto_waiting = None
        return jobs

    def has_auto_waiting(self) -> bool:
        with self._lock:
            return self._auto_waiting is not None
