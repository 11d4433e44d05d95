"""The batching scheduler: window levels driven by GPU and in-process load, NVML fallback, the batch queue.

No test asserts a duration: time is an injectable clock the test moves, and waits are bounded joins that
only fail when something never happens.
"""

from __future__ import annotations

import logging
import sys
import threading
from types import SimpleNamespace

import pytest

from inference_worker.config import WorkerConfig
from inference_worker.serving.scheduler import BatchQueue, GpuUtilization, LoadSignals, WindowConfig, WindowPolicy

MAX_BATCH = 8
JOIN_TIMEOUT_S = 10.0


class FakeClock:
    def __init__(self, now_s: float = 100.0):
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


class FakeNvml:
    """Stands in for NVML on an NVIDIA GPU, which this CI machine does not have (its real pynvml is tested
    below). Same call names as pynvml; `gpu_percent` is the utilisation the "device" reports."""

    def __init__(self, gpu_percent: float = 0.0, num_devices: int = 1):
        self.gpu_percent = gpu_percent
        self.num_devices = num_devices
        self.num_inits = self.num_shutdowns = self.num_queries = 0

    def nvmlInit(self):
        self.num_inits += 1

    def nvmlShutdown(self):
        self.num_shutdowns += 1

    def nvmlDeviceGetHandleByIndex(self, index: int):
        if index >= self.num_devices:
            raise RuntimeError("Invalid Argument")
        return ("gpu", index)

    def nvmlDeviceGetUtilizationRates(self, handle):
        self.num_queries += 1
        return SimpleNamespace(gpu=self.gpu_percent, memory=0)


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def cpu_gpu(clock):
    """The real pynvml on a machine without a GPU, as on a CPU deployment."""
    gpu = GpuUtilization(clock=clock)
    if gpu.percent() is not None:
        pytest.skip("NVML sees a GPU on this machine; the CPU path needs a machine without one")
    yield gpu
    gpu.close()


# ------------------------------------------------------------ window levels


def test_window_follows_gpu_load_levels(clock):
    nvml = FakeNvml()
    policy = WindowPolicy(WindowConfig(), LoadSignals(clock=clock), GpuUtilization(nvml=nvml, clock=clock))
    seen = []
    for gpu_percent in (10, 50, 90, 10):
        nvml.gpu_percent = gpu_percent
        clock.now_s += 1.0                  # past the sampling interval
        seen.append((policy.window_s(queue_depth=1, max_batch_size=MAX_BATCH), policy.last_level,
                     policy.last_load_pct, policy.last_source))
    assert seen == [(0.05, "low", 12.5, "gpu"), (0.15, "mid", 50.0, "gpu"),
                    (0.2, "high", 90.0, "gpu"), (0.05, "low", 12.5, "gpu")]


def test_configured_windows_and_thresholds_are_honoured(clock):
    nvml = FakeNvml()
    config = WindowConfig(windows_s=(0.01, 0.02, 0.03), thresholds_pct=(20.0, 40.0))
    policy = WindowPolicy(config, LoadSignals(clock=clock), GpuUtilization(nvml=nvml, clock=clock))
    windows = []
    for gpu_percent in (19.9, 20.0, 40.0, 40.1):   # LOW and HIGH themselves are mid load
        nvml.gpu_percent = gpu_percent
        clock.now_s += 1.0
        windows.append(policy.window_s(queue_depth=0, max_batch_size=MAX_BATCH))
    assert windows == [0.01, 0.02, 0.02, 0.03]


def test_gpu_blend_takes_the_busier_signal(clock):
    signals = LoadSignals(clock=clock)
    policy = WindowPolicy(WindowConfig(), signals, GpuUtilization(nvml=FakeNvml(gpu_percent=5), clock=clock))
    for _ in range(7):
        signals.request_started()
    assert policy.window_s(queue_depth=0, max_batch_size=MAX_BATCH) == 0.2
    assert (policy.last_level, policy.last_load_pct, policy.last_source) == ("high", 87.5, "gpu")


def test_cpu_window_follows_busy_share_of_the_horizon(clock, cpu_gpu):
    signals = LoadSignals(horizon_s=2.0, clock=clock)
    policy = WindowPolicy(WindowConfig(horizon_s=2.0), signals, cpu_gpu)
    assert policy.window_s(0, MAX_BATCH) == 0.05
    assert (policy.last_level, policy.last_source) == ("low", "in-process")

    signals.batch_finished(0.8)                     # 0.8 s busy in the last 2 s
    assert policy.window_s(0, MAX_BATCH) == 0.15
    assert (policy.last_level, policy.last_load_pct) == ("mid", pytest.approx(40.0))

    clock.now_s += 1.0
    signals.batch_finished(0.8)                     # 1.6 s busy in the last 2 s
    assert policy.window_s(0, MAX_BATCH) == 0.2
    assert (policy.last_level, policy.last_load_pct) == ("high", pytest.approx(80.0))

    clock.now_s += 2.5                              # both batches are older than the horizon
    assert policy.window_s(0, MAX_BATCH) == 0.05
    assert (policy.last_level, policy.last_load_pct, policy.last_source) == ("low", 0.0, "in-process")


def test_cpu_window_follows_requests_waiting(clock, cpu_gpu):
    signals = LoadSignals(clock=clock)
    policy = WindowPolicy(WindowConfig(), signals, cpu_gpu)
    assert [policy.window_s(depth, MAX_BATCH) for depth in (0, 2, 3, 6, 7, 20)] == \
        [0.05, 0.05, 0.15, 0.2, 0.2, 0.2]           # 0%, 25%, 37.5%, 75%, 87.5%, 100%
    for _ in range(7):
        signals.request_started()
    assert policy.window_s(0, MAX_BATCH) == 0.2
    for _ in range(7):
        signals.request_finished()
    assert policy.window_s(0, MAX_BATCH) == 0.05
    assert signals.in_flight == 0


def test_busy_share_counts_only_the_part_of_a_batch_inside_the_horizon(clock):
    signals = LoadSignals(horizon_s=2.0, clock=clock)
    signals.batch_finished(1.0, now_s=99.5)          # ran 98.5 .. 99.5
    assert signals.busy_percent(now_s=100.5) == pytest.approx(50.0)
    assert signals.busy_percent(now_s=101.0) == pytest.approx(25.0)
    assert signals.busy_percent(now_s=101.5) == 0.0


def test_request_finished_without_start_is_an_error():
    with pytest.raises(RuntimeError, match="request_started"):
        LoadSignals().request_finished()


def test_policy_rejects_signals_with_another_horizon():
    with pytest.raises(ValueError, match="horizon_s"):
        WindowPolicy(WindowConfig(horizon_s=2.0), LoadSignals(horizon_s=5.0))


# ------------------------------------------------------------ GPU utilisation


def test_real_nvml_without_gpu_is_unavailable(cpu_gpu, caplog):
    gpu = GpuUtilization()                           # cpu_gpu: skipped where NVML sees a GPU
    with caplog.at_level(logging.INFO, logger="inference_worker"):
        assert gpu.percent() is None
        assert gpu.percent() is None
    gpu.close()
    assert "NVML" in gpu.unavailable_reason
    assert len([r for r in caplog.records if "NVML" in r.getMessage()]) == 1


def test_missing_nvml_package_is_unavailable(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "pynvml", None)     # makes `import pynvml` raise ImportError
    gpu = GpuUtilization()
    with caplog.at_level(logging.INFO, logger="inference_worker"):
        assert gpu.percent() is None
        assert gpu.percent() is None
    assert "nvidia-ml-py" in gpu.unavailable_reason
    assert len([r for r in caplog.records if "nvidia-ml-py" in r.getMessage()]) == 1


def test_missing_device_is_unavailable_and_shuts_nvml_down():
    nvml = FakeNvml(num_devices=1)
    gpu = GpuUtilization(device_index=1, nvml=nvml)
    assert gpu.percent() is None
    assert "GPU 1" in gpu.unavailable_reason
    assert (nvml.num_inits, nvml.num_shutdowns) == (1, 1)


def test_gpu_is_opened_lazily_sampled_at_most_every_interval_and_closed(clock):
    nvml = FakeNvml(gpu_percent=40)
    gpu = GpuUtilization(nvml=nvml, min_interval_s=0.5, clock=clock)
    assert nvml.num_inits == 0
    assert gpu.percent() == 40.0
    nvml.gpu_percent = 90
    clock.now_s += 0.4
    assert gpu.percent() == 40.0                     # cached inside the interval
    clock.now_s += 0.1
    assert gpu.percent() == 90.0
    assert (nvml.num_inits, nvml.num_queries) == (1, 2)
    gpu.close()
    gpu.close()
    assert nvml.num_shutdowns == 1


# ------------------------------------------------------------ batch queue


def _take_in_thread(queue: BatchQueue, window_s, stop: threading.Event, poll_s: float = 0.01):
    """Start `take` on a thread; returns (thread, result list that gets the Batch or None)."""
    result = []
    thread = threading.Thread(target=lambda: result.append(queue.take(window_s, stop, poll_s)), daemon=True)
    thread.start()
    return thread, result


def _finished(thread: threading.Thread, result: list):
    thread.join(JOIN_TIMEOUT_S)
    assert not thread.is_alive(), "take() did not return"
    return result[0]


def test_full_batch_returns_without_waiting_for_the_window():
    queue = BatchQueue(max_batch_size=4)
    for item in "abcdef":
        queue.put(item)
    batch = _finished(*_take_in_thread(queue, lambda: 60.0, threading.Event()))
    assert batch.items == list("abcd") and batch.window_s == 60.0
    assert len(queue) == 2                           # the rest waits for the next batch


def test_put_wakes_take_when_the_batch_fills():
    queue = BatchQueue(max_batch_size=3)
    queue.put("a")
    thread, result = _take_in_thread(queue, lambda: 60.0, threading.Event(), poll_s=60.0)   # only a put wakes it
    queue.put("b")
    queue.put("c")
    assert _finished(thread, result).items == ["a", "b", "c"]


def test_take_waits_for_the_window_from_the_first_item(clock):
    queue = BatchQueue(max_batch_size=8, clock=clock)
    num_window_calls = []
    window_s = lambda: num_window_calls.append(1) or 1.0   # noqa: E731
    queue.put("a")                                   # t = 100.0: the window ends at 101.0
    clock.now_s += 0.25
    queue.put("b")
    thread, result = _take_in_thread(queue, window_s, threading.Event())
    clock.now_s += 0.5
    queue.put("c")                                   # t = 100.75, inside the window
    thread.join(0.05)
    assert thread.is_alive(), "take() returned before the window ended"
    clock.now_s += 0.25                              # t = 101.0
    batch = _finished(thread, result)
    assert batch.items == ["a", "b", "c"] and batch.window_s == 1.0
    assert batch.queue_wait_s == pytest.approx([1.0, 0.75, 0.25])
    assert len(num_window_calls) == 1


def test_items_that_waited_past_the_window_go_at_once(clock):
    queue = BatchQueue(max_batch_size=8, clock=clock)
    queue.put("a")
    queue.put("b")
    clock.now_s += 2.0
    batch = _finished(*_take_in_thread(queue, lambda: 1.0, threading.Event()))
    assert batch.items == ["a", "b"] and batch.queue_wait_s == [2.0, 2.0]


def test_retries_go_first_and_the_window_starts_at_the_oldest_item(clock):
    queue = BatchQueue(max_batch_size=8, clock=clock)
    queue.put("a")                                   # t = 100.0
    queue.put("b")
    clock.now_s += 0.75
    queue.put("retry", front=True)                   # t = 100.75; the window still ends at 101.0
    clock.now_s += 0.25
    batch = _finished(*_take_in_thread(queue, lambda: 1.0, threading.Event()))
    assert batch.items == ["retry", "a", "b"]
    assert batch.queue_wait_s == pytest.approx([0.25, 1.0, 1.0])


def test_take_ready_hands_over_what_is_queued_without_waiting_for_any_window(clock):
    """Rows joining a running decode: no window, retries first, at most the room the decode has."""
    queue = BatchQueue(max_batch_size=8, clock=clock)
    assert queue.take_ready(4).items == []
    queue.put("a")
    queue.put("b")
    queue.put("retry", front=True)
    clock.now_s += 0.5
    joined = queue.take_ready(2)
    assert joined.items == ["retry", "a"] and joined.window_s == 0.0
    assert joined.queue_wait_s == pytest.approx([0.5, 0.5])
    assert queue.take_ready(0).items == [] and len(queue) == 1
    assert queue.take_ready(5).items == ["b"] and len(queue) == 0


def test_stop_unblocks_an_empty_take():
    stop = threading.Event()
    thread, result = _take_in_thread(BatchQueue(max_batch_size=4), lambda: 0.0, stop)
    stop.set()
    assert _finished(thread, result) is None


def test_stop_during_the_window_leaves_items_for_drain():
    queue, stop = BatchQueue(max_batch_size=4), threading.Event()
    queue.put("a")
    thread, result = _take_in_thread(queue, lambda: 60.0, stop)
    queue.put("b")
    stop.set()
    assert _finished(thread, result) is None
    assert queue.drain() == ["a", "b"] and len(queue) == 0


def test_batch_queue_rejects_an_empty_batch_size():
    with pytest.raises(ValueError, match="max_batch_size must be an integer >= 1"):
        BatchQueue(max_batch_size=0)


# ------------------------------------------------------------ config


def test_window_config_from_worker_config():
    config = WindowConfig.from_worker_config(WorkerConfig(batch_window_ms=(10, 20, 30), load_thresholds_pct=(5, 50)))
    assert config.windows_s == pytest.approx((0.01, 0.02, 0.03))
    assert config.thresholds_pct == (5.0, 50.0) and config.horizon_s == 2.0


@pytest.mark.parametrize("kwargs, message", [
    ({"windows_s": (0.05, 0.15)}, "windows_s must be three wait windows in seconds >= 0"),
    ({"windows_s": (0.05, -0.1, 0.2)}, "windows_s must be three wait windows in seconds >= 0"),
    ({"thresholds_pct": (70, 30)}, r"thresholds_pct must be two percentages LOW, HIGH with 0 <= LOW <= HIGH <= 100"),
    ({"thresholds_pct": (30, 170)}, "thresholds_pct must be two percentages"),
    ({"thresholds_pct": (30,)}, "thresholds_pct must be two percentages"),
    ({"horizon_s": 0}, r"horizon_s must be a number of seconds > 0; got 0"),
])
def test_window_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WindowConfig(**kwargs)


# ------------------------------------------------------------ expected batch size (concurrency seen lately)

def test_peak_in_flight_remembers_the_horizon(clock):
    signals = LoadSignals(2.0, clock=clock)
    for _ in range(3):
        signals.request_started()
    for _ in range(3):
        signals.request_finished()
    assert signals.in_flight == 0 and signals.recent_peak_in_flight() == 3      # three clients, lately
    clock.now_s += 2.5
    assert signals.recent_peak_in_flight() == 0
    signals.request_started()
    assert signals.recent_peak_in_flight() == 1


def test_a_batch_holding_every_expected_request_goes_without_waiting_for_the_window():
    """One client at a time never waits for companions that are not coming; four clients fill a batch of four."""
    queue = BatchQueue(max_batch_size=8)
    queue.put("alone")
    result = []
    take = threading.Thread(target=lambda: result.append(queue.take(lambda: 60.0, threading.Event(), 60.0,
                                                                    expected_size=lambda: 1)), daemon=True)
    take.start()
    assert _finished(take, result).items == ["alone"]

    four = []
    thread = threading.Thread(target=lambda: four.append(queue.take(lambda: 60.0, threading.Event(), 60.0,
                                                                    expected_size=lambda: 4)), daemon=True)
    queue.put("a")
    thread.start()
    for item in "bcd":
        queue.put(item)
    assert _finished(thread, four).items == list("abcd")      # only a put could wake it: poll is 60 s
