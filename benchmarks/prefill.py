"""Prefill of N cold joiners, one by one against together (the batch decoder's model-thread work only, no HTTP):
the tiny random MiniCPM-V 4.6 fixture (hybrid linear/full attention, NaViT-packed images) next to Idefics3.

Per family, per N (1, 4, 8) and per reuse mode, N prepared requests (distinct questions and colours; MiniCPM-V with
images of three shapes, Idefics3 with one, as its images must stack) are prefilled
- "one by one": the decoder's `RowPrefill.prefill` per row, what each row costs alone;
- "together": its `PrefillTogether.prefill` over all N (N = 1 is a lone row: prefilled alone).
Reuse modes: "off" (no frame cache: the whole prompt in one forward) and "frame kept" (a frame-cache miss whose
prefix is kept: a hybrid cache prefills the prefixes together, then the suffixes of equal length together; a plain
one copies the prefix out of the whole-prompt forward). The frame cache is emptied before every timed round so each
round is cold. Rounds alternate the two ways, median of --repeats, 1 torch thread. Each row's first-token logits
from the two ways are compared (max difference printed), and the rows the group prefill took are counted
("grouped": N where it batched every row, 0 for a lone row).

    .venv/bin/python -m benchmarks.prefill [--rows 1,4,8] [--repeats 5] [--json-out PATH]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._results import write_result

DEFAULT_JSON_OUT = Path("benchmarks/results/prefill.json")
KV_BYTES = 256 * 1024 * 1024
QUESTIONS = ("What is on this screen?", "Which window has focus?", "List the buttons.", "Any errors shown?",
             "What is the title of the window in front?", "Summarise the text.", "Is a dialog open?",
             "Which application is this, and what is it doing?")
PACKED_SIZES = ((112, 112), (224, 112), (112, 224))
FAMILIES = ("minicpmv46", "idefics3")
MODES = ("off", "frame kept")


def build_engine(family: str, folder: Path, *, kv_cache_bytes: int):
    from inference_worker.engines import EngineOptions, load_hf_engine
    from tests.fixtures import tiny_models

    checkpoint = folder / family
    if not checkpoint.exists():
        getattr(tiny_models, f"build_tiny_{family}")(checkpoint)
    return load_hf_engine(str(checkpoint), EngineOptions(device="cpu", num_threads=1, kv_cache_bytes=kv_cache_bytes),
                          progress=False)


def requests_for(family: str, num_rows: int) -> list[tuple[Any, list]]:
    from tests.fixtures.chat_requests import chat_request, png_bytes

    out = []
    for i in range(num_rows):
        size = PACKED_SIZES[i % len(PACKED_SIZES)] if family == "minicpmv46" else (96, 64)
        color = (40 + 25 * i, 200 - 20 * i, 90 + 15 * i)
        out.append(chat_request(QUESTIONS[i % len(QUESTIONS)], png_bytes(color, size), max_tokens=8, temperature=0))
    return out


def one_by_one(engine, rows) -> tuple[float, list[torch.Tensor], int]:
    decoder = engine.decoder
    started = time.perf_counter()
    logits = [decoder.row_prefill.prefill(row.inputs)[1] for _, row in rows]
    return time.perf_counter() - started, logits, 0


def together(engine, rows) -> tuple[float, list[torch.Tensor], int]:
    """Returns also how many rows the group prefill took (the rest, lone or failed, are prefilled alone)."""
    decoder = engine.decoder
    started = time.perf_counter()
    prefilled = decoder.together.prefill(rows)
    grouped = [i for i, _ in rows if isinstance(prefilled.get(i), tuple)]
    logits = [prefilled[i][1] if i in grouped else decoder.row_prefill.prefill(row.inputs, prefilled.get(i))[1]
              for i, row in rows]
    return time.perf_counter() - started, logits, len(grouped)


def measure(engine, family: str, num_rows: int, mode: str, repeats: int) -> dict[str, Any]:
    items = [engine.prepare(request) for request, images in requests_for(family, num_rows)]
    if mode == "off":
        for item in items:
            item.inputs.frame = None
    rows = [(i, engine.decoder_row(item)) for i, item in enumerate(items)]
    times: dict[str, list[float]] = {"one by one": [], "together": []}
    logits: dict[str, list[torch.Tensor]] = {}
    num_grouped = 0
    for round_index in range(repeats + 1):                  # round 0 warms up
        ways = (("one by one", one_by_one), ("together", together))
        for name, way in (ways if round_index % 2 == 0 else ways[::-1]):
            if engine.frame_cache is not None:
                engine.frame_cache.clear()
            elapsed_s, logits[name], grouped = way(engine, rows)
            num_grouped = max(num_grouped, grouped)
            if round_index:
                times[name].append(elapsed_s)
    gap = max((a - b).abs().max().item() for a, b in zip(logits["one by one"], logits["together"]))
    alone_ms = statistics.median(times["one by one"]) * 1000 / num_rows
    together_ms = statistics.median(times["together"]) * 1000 / num_rows
    return {"family": family, "rows": num_rows, "reuse": mode, "one_by_one_ms_per_row": round(alone_ms, 3),
            "together_ms_per_row": round(together_ms, 3), "speedup": round(alone_ms / together_ms, 2),
            "max_logit_gap": gap, "rows_prefilled_together": num_grouped,
            "prompt_tokens": [item.inputs.num_tokens for item in items]}


def run(row_counts: list[int], repeats: int) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    results = []
    with tempfile.TemporaryDirectory(prefix="deskeye_prefill_bench_") as folder:
        for family in FAMILIES:
            engine = build_engine(family, Path(folder), kv_cache_bytes=KV_BYTES)
            try:
                for mode in MODES:
                    for num_rows in row_counts:
                        results.append(measure(engine, family, num_rows, mode, repeats))
                        print_row(results[-1])
            finally:
                engine.close()
    return results


def print_row(result: dict[str, Any]) -> None:
    print(f"{result['family']:<11} {result['reuse']:<10} {result['rows']:>4} {result['one_by_one_ms_per_row']:>12.2f} "
          f"{result['together_ms_per_row']:>12.2f} {result['speedup']:>7.2f}x {result['max_logit_gap']:>10.1e} "
          f"{result['rows_prefilled_together']:>8}",
          flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,8", help="numbers of cold joiners, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json-out", type=Path, default=DEFAULT_JSON_OUT)
    args = parser.parse_args(argv)
    row_counts = [int(n) for n in args.rows.split(",") if n.strip()]
    if not row_counts or min(row_counts) < 1 or args.repeats < 1:
        parser.error("--rows takes positive integers and --repeats at least 1")
    print(f"{'family':<11} {'reuse':<10} {'rows':>4} {'alone ms/row':>12} {'together':>12} {'speedup':>8} "
          f"{'logit gap':>10} {'grouped':>8}")
    results = run(row_counts, args.repeats)
    write_result(args.json_out, {"benchmark": "prefill", "repeats": args.repeats, "torch_threads": 1,
                                 "results": results})


if __name__ == "__main__":
    main()
