"""Soak: `deskeye run` with the OCR worker on a desktop with a tray host, the watched window changing every
second for about five minutes (~300 describes). At the end the app's memory (RSS) has not grown and a hotkey
describe is still answered within 5 s. The worker's /metrics counts the describes."""

from __future__ import annotations

import time

import psutil
import pytest

from tests.fixtures.deskeye_process import start_deskeye
from tests.fixtures.desktop import start_desktop
from tests.fixtures.polling import wait_until
from tests.fixtures.tk_windows import open_test_window

pytestmark = [pytest.mark.desktop, pytest.mark.subprocess]

SOAK_S = 300.0
CHANGE_EVERY_S = 1.0
WARMUP_S = 60.0                          # RSS is compared from here (imports, OCR model, caches are in by then)
MAX_RSS_GROWTH_MB = 30.0
HOTKEY_ANSWER_S = 5.0
SETTINGS = ('[capture]\nregion = "200,200,480,160"\ninterval_s = 0.5\n[overlay]\nfade_after_s = 2.0\n'
            '[worker]\nengine = "ocr"\n[hooks]\ndry_run = true\n')
WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"]


@pytest.mark.slow
@pytest.mark.timeout(SOAK_S + 300)
def test_five_minutes_of_a_changing_screen_keep_memory_flat_and_the_hotkey_answering():
    desktop = start_desktop(1600, 900, tray="trayer")
    window = open_test_window(desktop.display, "Build log", "480x160+200+200", lines=["Build 0 started", "step"])
    app = start_deskeye(desktop, settings=SETTINGS)
    try:
        assert app.read_until("deskeye: watching", 90), "".join(app.output)
        assert wait_until(lambda: app.chat_requests() >= 1, 120)
        process = psutil.Process(app.proc.pid)
        start, first = time.monotonic(), app.chat_requests()
        baseline_mb = None
        tick = 0
        while (elapsed := time.monotonic() - start) < SOAK_S:
            tick += 1
            window.set_line(0, f"Build {tick} {WORDS[tick % len(WORDS)]} step {tick * 7}")
            if baseline_mb is None and elapsed >= WARMUP_S:
                baseline_mb = process.memory_info().rss / 2**20
            time.sleep(max(0.0, start + tick * CHANGE_EVERY_S - time.monotonic()))
        described = app.chat_requests() - first
        end_mb = process.memory_info().rss / 2**20
        print(f"soak: {described} describes in {SOAK_S:.0f} s; app RSS {baseline_mb:.1f} MB at "
              f"{WARMUP_S:.0f} s, {end_mb:.1f} MB at the end")
        assert described >= 0.6 * SOAK_S / CHANGE_EVERY_S, f"only {described} describes"
        assert end_mb - baseline_mb < MAX_RSS_GROWTH_MB, (baseline_mb, end_mb)

        settled = wait_until(lambda: not app.overlay_rect(), 30)      # quiet, the overlay faded
        assert settled
        before = app.chat_requests()
        pressed = time.monotonic()
        desktop.xdotool("key", "ctrl+alt+d")
        assert wait_until(lambda: app.chat_requests() > before and app.overlay_rect(), HOTKEY_ANSWER_S), \
            f"no answer within {HOTKEY_ANSWER_S} s of the hotkey"
        print(f"soak: hotkey answered in {time.monotonic() - pressed:.2f} s")
        assert app.proc.poll() is None
    finally:
        app.stop()
        window.close()
        desktop.stop()
