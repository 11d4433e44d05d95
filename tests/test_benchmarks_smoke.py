"""benchmarks/throughput.py runs end to end (--smoke: real workers on the tiny fixture model, real HTTP) and
its JSON has every section filled with numbers. Speed itself is never asserted here: it is what the benchmark
prints, and this shared 2-core machine is too noisy to test it."""

from __future__ import annotations

import pytest

import json
from numbers import Number

from benchmarks import throughput


def _is_number(value) -> bool:
    return isinstance(value, Number) and not isinstance(value, bool)


@pytest.mark.slow
def test_throughput_smoke_writes_every_section(tmp_path):
    out = tmp_path / "throughput.json"
    assert throughput.main(["--smoke", "--json-out", str(out)]) == 0
    report = json.loads(out.read_text(encoding="utf-8"))

    plan = throughput.PLANS["smoke"]
    rows = {(r["part"], r["output"], r["num_clients"]): r for r in report["throughput"]}
    expected = {("(i)", output, 1) for output in ("json", "free")}
    expected |= {("(ii)", output, n) for output in ("json", "free") for n in plan.levels}
    assert set(rows) == expected
    for row in rows.values():
        assert row["num_ok"] == row["num_requests"] == plan.num_requests, row["errors"]
        for key in ("requests_per_s", "tokens_per_s", "p50_ms", "p95_ms", "mean_batch_size", "server_ttft_p50_ms"):
            assert _is_number(row[key]), (key, row)
        assert _is_number(row["mean_live_rows"]) and 1 <= row["mean_live_rows"] <= row["num_clients"], row
        assert 0 < row["model_busy_share"] <= 1.05 and 0 < row["model_on_cpu_share"] <= 1.05, row
        assert _is_number(row["worker_cpu_ms_per_request"]) and row["worker_cpu_ms_per_request"] > 0, row
        if row["output"] == "free":              # fixed work per request: every answer runs to max_tokens
            assert row["tokens_per_request"] == report["max_tokens"]

    serve = report["transformers_serve"]
    assert serve["available"] is False and "--smoke" in serve["reason"]

    cases = report["repeated_frame"]["cases"]
    assert {case: c["kv_cache"] for case, c in cases.items()} == {
        "cold": {"miss": 1}, "exact": {"exact": 1}, "similar": {"similar": 1}}
    for c in cases.values():
        assert all(_is_number(c[key]) for key in ("ttft_p50_ms", "server_total_p50_ms", "client_total_p50_ms"))

    grammar = report["grammar"]
    assert grammar["num_pairs"] == 1
    assert grammar["json"]["tokens_per_request"] == grammar["free"]["tokens_per_request"]
    assert _is_number(grammar["server_ratio"]) and _is_number(grammar["client_ratio"])
    assert _is_number(grammar["json"]["grammar_mask_ms_per_token"])

    model_only = report["model_only"]
    assert model_only["num_requests"] == plan.anchor_clients
    assert all(_is_number(model_only[k]) and model_only[k] > 0 for k in ("one_at_a_time_ms", "batched_ms", "ratio"))

    found = {t["target"]: t for t in report["targets"]}
    assert len(found) == 7
    serve_target = next(t for name, t in found.items() if "transformers serve" in name)
    assert serve_target["met"] is None                 # not measured in --smoke, so neither met nor missed
    for t in (t for t in found.values() if t is not serve_target):
        assert _is_number(t["ratio"]) and isinstance(t["met"], bool), t


def test_the_speedup_target_is_the_median_of_each_rounds_own_ratio():
    """Rounds alternate the two workers; a round pairs (ii) with the (i) measured beside it, so a machine that
    slows down between rounds moves both numbers of a pair, not the ratio."""
    def row(part, clients, rps, round_):
        return throughput.LoadRow(part=part, server="s", output="json", num_clients=clients, num_requests=8,
                                  num_ok=8, wall_s=1.0, requests_per_s=rps, tokens_per_s=1.0,
                                  tokens_per_request=1.0, p50_ms=1.0, p95_ms=1.0, mean_batch_size=1.0,
                                  server_queue_p50_ms=1.0, server_ttft_p50_ms=1.0, round=round_)
    rows = [row("(i)", 1, 10.0, 0), row("(ii)", 8, 41.0, 0),       # 4.1x
            row("(i)", 1, 5.0, 1), row("(ii)", 8, 19.0, 1),        # the machine slowed down: 3.8x
            row("(i)", 1, 10.0, 2), row("(ii)", 8, 42.0, 2),       # 4.2x
            row("(ii)", 4, 99.0, 0)]                               # another client count: not paired
    batched, single, speedup = throughput.speedup_over_rounds(rows, "json", 8)
    assert (batched, single, speedup) == (41.0, 10.0, 4.1)
    assert throughput.speedup_over_rounds(rows, "free", 8) == (None, None, None)


def wayland_smoke(test):
    """A benchmark smoke test on a real desktop (headless GNOME, Xvfb): slow, with a desktop and subprocesses."""
    for mark in (pytest.mark.desktop, pytest.mark.subprocess, pytest.mark.slow):
        test = mark(test)
    return test


@wayland_smoke
def test_app_idle_measures_deskeye_run_on_gnome(tmp_path):
    """`benchmarks.app_idle --desktop gnome`: the real `deskeye run --engine ocr` inside a headless GNOME session,
    which described the native window once (through the portal's ScreenCast) before the window was measured."""
    from benchmarks import app_idle

    out = tmp_path / "app_idle.json"
    assert app_idle.main(["--desktop", "gnome", "--minutes", "0.05", "--json-out", str(out)]) == 0
    report = json.loads(out.read_text(encoding="utf-8"))
    (row,) = report["rows"]
    assert (report["desktop"], row["desktop"], row["case"]) == ("gnome", "gnome", "static screen")
    assert row["capture"] == "xdg-desktop-portal ScreenCast (GNOME)" and row["window_s"] == 3.0
    for key in ("cpu_percent_of_one_core", "app_cpu_percent", "worker_cpu_percent", "desktop_cpu_percent",
                "describes_per_minute", "load_1min"):
        assert _is_number(row[key]) and row[key] >= 0, (key, row)
    assert {"gnome-shell", "Xwayland", "pipewire"} <= set(row["desktop_programs"]), row     # counted as the desktop
    said = "\n".join(row["app_said"])
    assert "Traceback" not in said and "capture failed" not in said.lower(), said


@wayland_smoke
def test_portal_capture_times_screencast_screenshot_and_mss(tmp_path):
    """`benchmarks.portal_capture` on GNOME (ScreenCast, Screenshot) and Xvfb (mss), a few grabs each: every change
    of the window's colour is seen and timed, and the screenshots show the window (not black, not the desktop).
    sway's Screenshot is left out: its portal writes the fixed /tmp/out.png, which tests/test_wayland_privacy.py
    uses in another test process."""
    from benchmarks import portal_capture

    out = tmp_path / "portal_capture.json"
    assert portal_capture.main(["--desktops", "gnome,x11", "--grabs", "3", "--shots", "2", "--static-s", "1",
                                "--json-out", str(out)]) == 0
    report = json.loads(out.read_text(encoding="utf-8"))
    rows = {(row["desktop"], row["backend"]): row for row in report["rows"]}
    streamed, shot = rows[("gnome", "xdg-desktop-portal ScreenCast (GNOME)")], rows[
        ("gnome", "xdg-desktop-portal Screenshot (GNOME)")]
    mss = next(row for (desktop, _), row in rows.items() if desktop == "x11")
    assert len(rows) == 3 and mss["backend"].startswith("mss on the X display"), list(rows)
    for row in (streamed, mss):
        assert row["damage_to_frame"]["n"] + row["unmatched_changes"] == 3, row["raw"]
        assert row["damage_to_frame"]["n"] >= 2, row["raw"]
        assert all(_is_number(row[part][key]) and row[part][key] > 0
                   for part in ("grab_call", "damage_to_frame") for key in ("p50_ms", "p90_ms")), row
    assert isinstance(streamed["frames_while_static"], int) and streamed["frames_while_static"] >= 0, streamed
    assert shot["grab_call"]["n"] == 2 and _is_number(shot["grab_call"]["p50_ms"]), shot
    assert shot["raw"]["colours_seen"] >= 1, shot["raw"]      # the window's colour, in the portal's picture
