"""When the model thread starts a batch: a queue that gathers requests for a load-adaptive wait window.

The window starts at the oldest queued request and is short when the worker is idle (answer fast) and longer
under load (gather bigger batches, where each extra row costs little). Load comes from the GPU (NVML) where
there is one, blended with in-process signals: requests in flight, queue depth and the share of recent time
spent in batches. On a CPU the in-process signals are the only ones. A full batch never waits.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger("inference_worker")

Clock = Callable[[], float]
LEVELS = ("low", "mid", "high")


@dataclass(frozen=True)
class WindowConfig:
    windows_s: tuple[float, float, float] = (0.05, 0.15, 0.2)   # wait window at low / mid / high load
    thresholds_pct: tuple[float, float] = (30.0, 70.0)         # load (%) where the window steps up
    horizon_s: float = 2.0                                      # how far back in-process load looks

    def __post_init__(self):
        object.__setattr__(self, "windows_s", tuple(float(v) for v in self.windows_s))
        object.__setattr__(self, "thresholds_pct", tuple(float(v) for v in self.thresholds_pct))
        if len(self.windows_s) != 3 or any(v < 0 for v in self.windows_s):
            raise ValueError(f"windows_s must be three wait windows in seconds >= 0 (low, mid, high load); "
                             f"got {self.windows_s!r}.")
        low_high = self.thresholds_pct
        if len(low_high) != 2 or not 0 <= low_high[0] <= low_high[1] <= 100:
            raise ValueError(f"thresholds_pct must be two percentages LOW, HIGH with 0 <= LOW <= HIGH <= 100; "
                             f"got {self.thresholds_pct!r}.")
        if not self.horizon_s > 0:
            raise ValueError(f"horizon_s must be a number of seconds > 0; got {self.horizon_s!r}.")

    @classmethod
    def from_worker_config(cls, config) -> WindowConfig:
        """From a WorkerConfig's `batch_window_ms` and `load_thresholds_pct`."""
        return cls(windows_s=tuple(ms / 1000 for ms in config.batch_window_ms),
                   thresholds_pct=tuple(config.load_thresholds_pct))


class GpuUtilization:
    """A GPU's utilisation (%) from NVML, opened on first use and sampled at most every `min_interval_s`."""

    def __init__(self, device_index: int = 0, *, min_interval_s: float = 0.5, nvml: Any = None,
                 clock: Clock = time.monotonic):
        self.device_index = device_index
        self.min_interval_s = min_interval_s
        self.unavailable_reason = ""        # set once NVML turned out to be unusable; percent() is then None
        self._nvml = nvml                   # the pynvml module; None = import it on first use
        self._clock = clock
        self._lock = threading.Lock()
        self._handle = None
        self._is_initialised = False
        self._sampled_at_s: float | None = None
        self._percent: float | None = None

    def percent(self) -> float | None:
        """The latest utilisation sample, or None where NVML is unavailable (see `unavailable_reason`)."""
        with self._lock:
            if self.unavailable_reason or (self._handle is None and not self._open()):
                return None
            now_s = self._clock()
            if self._sampled_at_s is not None and now_s - self._sampled_at_s < self.min_interval_s:
                return self._percent
            try:
                self._percent = float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
            except Exception as exc:  # noqa: BLE001 - NVMLError subclasses (not supported, GPU lost, ...)
                self._give_up(f"NVML could not read the utilisation of GPU {self.device_index}: {exc}")
                return None
            self._sampled_at_s = now_s
            return self._percent

    def close(self) -> None:
        with self._lock:
            self._shutdown()

    def _open(self) -> bool:
        try:
            self._nvml = self._nvml or importlib.import_module("pynvml")
        except ImportError as exc:
            return self._give_up(f"NVML is unavailable: the nvidia-ml-py package is not installed ({exc})")
        try:
            self._nvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound on machines without a driver
            return self._give_up(f"NVML is unavailable: {exc}")
        self._is_initialised = True
        try:
            self._handle = self._nvml.nvmlDeviceGetHandleByIndex(self.device_index)
        except Exception as exc:  # noqa: BLE001
            return self._give_up(f"NVML has no GPU {self.device_index}: {exc}")
        return True

    def _give_up(self, reason: str) -> bool:
        """Stop using NVML for good; says so once in the log. Returns False (not opened)."""
        self.unavailable_reason = reason
        self._shutdown()
        log.info("%s; the batch window follows in-process load only", reason)
        return False

    def _shutdown(self) -> None:
        if self._is_initialised:
            self._is_initialised, self._handle = False, None
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001 - closing must not fail shutdown
                log.debug("nvmlShutdown failed", exc_info=True)


class LoadSignals:
    """In-process load: requests in flight (submit to answer) and the batches that ran in the last horizon."""

    def __init__(self, horizon_s: float = 2.0, *, clock: Clock = time.monotonic):
        self.horizon_s = horizon_s
        self._clock = clock
        self._lock = threading.Lock()
        self._in_flight = 0
        self._batches: deque[tuple[float, float]] = deque()    # (start_s, end_s), oldest first
        self._arrivals: deque[tuple[float, int]] = deque()     # (time_s, in flight after that arrival)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def request_started(self) -> None:
        now_s = self._clock()
        with self._lock:
            self._in_flight += 1
            self._arrivals.append((now_s, self._in_flight))
            while self._arrivals and self._arrivals[0][0] <= now_s - self.horizon_s:
                self._arrivals.popleft()

    def recent_peak_in_flight(self, now_s: float | None = None) -> int:
        """The most requests in flight at once during the last `horizon_s` (at least those in flight now):
        how many clients are sending concurrently, so how big a batch can be expected."""
        since_s = (self._clock() if now_s is None else now_s) - self.horizon_s
        with self._lock:
            recent = (count for time_s, count in self._arrivals if time_s > since_s)
            return max(self._in_flight, max(recent, default=0))

    def request_finished(self) -> None:
        with self._lock:
            if self._in_flight == 0:
                raise RuntimeError("request_finished() without a matching request_started()")
            self._in_flight -= 1

    def batch_finished(self, duration_s: float, now_s: float | None = None) -> None:
        end_s = self._clock() if now_s is None else now_s
        with self._lock:
            self._batches.append((end_s - max(0.0, duration_s), end_s))
            self._forget_before(end_s - self.horizon_s)

    def busy_percent(self, now_s: float | None = None) -> float:
        """Share (0-100) of the last `horizon_s` that the model spent running batches."""
        now_s = self._clock() if now_s is None else now_s
        since_s = now_s - self.horizon_s
        with self._lock:
            self._forget_before(since_s)
            busy_s = sum(max(0.0, min(end, now_s) - max(start, since_s)) for start, end in self._batches)
        return min(100.0, 100.0 * busy_s / self.horizon_s)

    def _forget_before(self, since_s: float) -> None:
        while self._batches and self._batches[0][1] <= since_s:
            self._batches.popleft()


class WindowPolicy:
    """Picks the wait window from the load level; remembers the last load for /metrics and logs."""

    def __init__(self, config: WindowConfig, signals: LoadSignals, gpu: GpuUtilization | None = None):
        if signals.horizon_s != config.horizon_s:
            raise ValueError(f"LoadSignals.horizon_s ({signals.horizon_s}) must equal WindowConfig.horizon_s "
                             f"({config.horizon_s}); build it as LoadSignals(config.horizon_s).")
        self.config = config
        self.signals = signals
        self.gpu = gpu
        self.last_load_pct = 0.0
        self.last_level = "low"
        self.last_source = "in-process"     # "gpu" when a GPU reading took part in the blend

    def window_s(self, queue_depth: int, max_batch_size: int) -> float:
        """The window for the next batch.

        In-process load is the larger of the busy share and how full a batch the waiting requests would make.
        With a GPU reading, load is the larger of the two: any sign that the device is busy means a longer
        wait fills a bigger batch at little latency cost, since a new batch could not start sooner anyway.
        """
        in_process_pct = max(self.signals.busy_percent(),
                             100.0 * min(1.0, max(self.signals.in_flight, queue_depth) / max_batch_size))
        gpu_pct = self.gpu.percent() if self.gpu is not None else None
        self.last_source = "in-process" if gpu_pct is None else "gpu"
        self.last_load_pct = in_process_pct if gpu_pct is None else max(gpu_pct, in_process_pct)
        low, high = self.config.thresholds_pct
        level = 0 if self.last_load_pct < low else 1 if self.last_load_pct <= high else 2
        self.last_level = LEVELS[level]
        return self.config.windows_s[level]


@dataclass
class Batch:
    items: list
    queue_wait_s: list[float]           # per item: time taken minus time queued
    window_s: float                     # the window this batch waited for


class BatchQueue:
    """Thread-safe FIFO that hands out batches; `put` from any thread, `take` from the one model thread."""

    def __init__(self, max_batch_size: int, *, clock: Clock = time.monotonic):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1; got {max_batch_size!r}.")
        self.max_batch_size = max_batch_size
        self._clock = clock
        self._cond = threading.Condition()
        self._entries: deque[tuple[float, Any]] = deque()    # (enqueued_s, item)

    def __len__(self) -> int:
        with self._cond:
            return len(self._entries)

    def put(self, item: Any, *, front: bool = False) -> None:
        """Queue an item; `front=True` (retries) puts it before everything queued."""
        with self._cond:
            entry = (self._clock(), item)
            self._entries.appendleft(entry) if front else self._entries.append(entry)
            self._cond.notify_all()

    def take(self, window_s: Callable[[], float], stop: threading.Event, poll_s: float | None = None,
             expected_size: Callable[[], int] | None = None) -> Batch | None:
        """The next batch: waits for an item, then until the oldest item has waited `window_s()` or the batch is
        full: `max_batch_size` items, or `expected_size()` when that is smaller (every request the caller knows
        of is here: waiting longer would only delay them). None once `stop` is set; queued items then stay for
        `drain()`. `window_s` is called once per batch, without the queue's lock held (it may read NVML);
        `expected_size` while it is held, so it must be quick and lock-free of us.

        The wait is event-driven: it sleeps until a `put`, the window's end, or `wake()`, so whoever sets `stop`
        calls `wake()` next (an idle worker's model thread then never wakes at all). `poll_s` also looks again
        every `poll_s` seconds: for a `stop` set by someone who does not call `wake()`, or a clock that is not
        the real one (tests)."""
        while self._wait(lambda: bool(self._entries), stop, poll_s):
            window = max(0.0, float(window_s()))
            with self._cond:
                if not self._entries:        # drained meanwhile
                    continue
                deadline_s = min(enqueued_s for enqueued_s, _ in self._entries) + window
                if self._wait(lambda: self._is_batch_ready(deadline_s, expected_size), stop, poll_s, deadline_s):
                    return self._pop_batch(window)
        return None

    def wake(self) -> None:
        """Wake a waiting `take` so it looks at its `stop` event again (set that first). Any thread."""
        with self._cond:
            self._cond.notify_all()

    def take_ready(self, max_items: int) -> Batch:
        """Up to `max_items` queued items at once, without waiting (rows joining a running decode: the window
        applies only to a batch that starts from idle); an empty batch when none are queued."""
        with self._cond:
            count = max(0, min(max_items, len(self._entries)))
            now_s = self._clock()
            entries = [self._entries.popleft() for _ in range(count)]
        return Batch(items=[item for _, item in entries], queue_wait_s=[now_s - queued_s for queued_s, _ in entries],
                     window_s=0.0)

    def drain(self) -> list:
        """Remove and return every queued item (at shutdown)."""
        with self._cond:
            items = [item for _, item in self._entries]
            self._entries.clear()
            return items

    def _wait(self, is_done: Callable[[], bool], stop: threading.Event, poll_s: float | None,
              deadline_s: float | None = None) -> bool:
        """Wait until `is_done()`; False if `stop` was set first. Sleeps until notified, `deadline_s` or
        `poll_s`, whichever comes first (no timeout at all when both are None)."""
        with self._cond:
            while not is_done():
                if stop.is_set():
                    return False
                timeouts_s = [] if poll_s is None else [poll_s]
                if deadline_s is not None:
                    timeouts_s.append(max(0.0, deadline_s - self._clock()))
                self._cond.wait(min(timeouts_s, default=None))
            return not stop.is_set()

    def _is_batch_ready(self, deadline_s: float, expected_size: Callable[[], int] | None) -> bool:
        full_size = self.max_batch_size
        if expected_size is not None:
            full_size = max(1, min(full_size, expected_size()))
        return len(self._entries) >= full_size or self._clock() >= deadline_s

    def _pop_batch(self, window: float) -> Batch:
        now_s = self._clock()
        count = min(self.max_batch_size, len(self._entries))
        entries = [self._entries.popleft() for _ in range(count)]
        return Batch(items=[item for _, item in entries],
                     queue_wait_s=[now_s - enqueued_s for enqueued_s, _ in entries], window_s=window)
