"""Per-token decode cost with and without the JSON-schema grammar, on the same model and prompts.

For each prompt and run, the constrained request (DeskEye's schema, sampled with a fixed seed) goes first;
the unconstrained one then generates exactly as many tokens (a random model almost never emits EOS), so
both columns divide the same work by the same token count. Printed as a table and written as JSON.

    .venv/bin/python -m benchmarks.grammar_overhead [--model PATH] [--runs 5] [--json-out PATH]

Without --model it builds the tiny random Idefics3 test fixture into a temporary folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks._results import write_result

DEFAULT_JSON_OUT = Path("benchmarks/results/grammar_overhead.json")
PROMPTS = (
    ("What is on this screen?", (220, 30, 30)),
    ("Which window has focus, and what does it show?", (30, 160, 60)),
    ("List the buttons you can see.", (30, 30, 220)),
)


@dataclass
class Row:
    prompt: str
    runs: int
    tokens_per_run: float
    unconstrained_ms_per_token: float
    constrained_ms_per_token: float
    ratio: float
    grammar_ms_per_token: float


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model folder or Hub id (default: build the tiny Idefics3 fixture)")
    parser.add_argument("--runs", type=int, default=5, help="runs per prompt (default 5)")
    parser.add_argument("--max-tokens", type=int, default=256, help="max_tokens of the constrained request")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: stable on shared cores)")
    parser.add_argument("--device", default="cpu", choices=("auto", "cuda", "cpu"))
    parser.add_argument("--json-out", type=Path, default=DEFAULT_JSON_OUT)
    args = parser.parse_args(argv)
    if args.runs < 1 or args.max_tokens < 1 or args.threads < 1:
        parser.error("--runs, --max-tokens and --threads must be at least 1")
    return args


def measure_prompt(constrained, unconstrained, question: str, color, *, runs: int, max_tokens: int) -> Row:
    from inference_worker.engines.base import run_one
    from tests.fixtures.chat_requests import chat_request, png_bytes, with_sampling

    request, _ = chat_request(question, png_bytes(color), deskeye_schema=True, max_tokens=max_tokens)
    free_request = dataclasses.replace(request, json_schema=None, schema_name=None)
    times = {"constrained": [], "unconstrained": []}
    grammar_ms, tokens = [], []
    for run in range(runs):
        sampled = with_sampling(request, temperature=1.0, seed=run)
        started = time.perf_counter()
        answer = run_one(constrained, sampled)
        times["constrained"].append((time.perf_counter() - started) * 1000 / answer.completion_tokens)
        grammar_ms.append(answer.facts.grammar_ms / answer.completion_tokens)
        tokens.append(answer.completion_tokens)
        free = with_sampling(free_request, temperature=1.0, seed=run, max_tokens=answer.completion_tokens)
        started = time.perf_counter()
        free_answer = run_one(unconstrained, free)
        times["unconstrained"].append((time.perf_counter() - started) * 1000 / free_answer.completion_tokens)
    unconstrained_ms = statistics.median(times["unconstrained"])
    constrained_ms = statistics.median(times["constrained"])
    return Row(question, runs, statistics.mean(tokens), round(unconstrained_ms, 3), round(constrained_ms, 3),
               round(constrained_ms / unconstrained_ms, 3), round(statistics.median(grammar_ms), 3))


def print_table(rows: list[Row]) -> None:
    header = f"{'prompt':<48} {'tok/run':>7} {'free ms/tok':>11} {'json ms/tok':>11} {'ratio':>6} {'mask ms/tok':>11}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r.prompt[:48]:<48} {r.tokens_per_run:>7.1f} {r.unconstrained_ms_per_token:>11.3f} "
              f"{r.constrained_ms_per_token:>11.3f} {r.ratio:>6.2f} {r.grammar_ms_per_token:>11.3f}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import llguidance
    import torch

    from inference_worker.engines import EngineOptions, load_hf_engine

    with tempfile.TemporaryDirectory(prefix="deskeye-bench-") as tmp:
        model = args.model
        if model is None:
            from tests.fixtures.tiny_models import build_tiny_idefics3
            model = str(build_tiny_idefics3(Path(tmp) / "tiny_idefics3"))
        options = dict(device=args.device, num_threads=args.threads)
        constrained = load_hf_engine(model, EngineOptions(use_grammar=True, **options), progress=False)
        unconstrained = load_hf_engine(model, EngineOptions(use_grammar=False, **options), progress=False)
        measure_prompt(constrained, unconstrained, *PROMPTS[0], runs=1, max_tokens=args.max_tokens)   # warm-up
        rows = [measure_prompt(constrained, unconstrained, q, c, runs=args.runs, max_tokens=args.max_tokens)
                for q, c in PROMPTS]
    print_table(rows)
    result = {
        "benchmark": "grammar_overhead", "model": args.model or "tiny random Idefics3 (tests/fixtures)",
        "device": str(constrained.device), "threads": args.threads, "runs_per_prompt": args.runs,
        "max_tokens": args.max_tokens, "torch": torch.__version__, "llguidance": llguidance.__version__,
        "statistic": "median over runs of wall ms / generated token",
        "median_ratio": round(statistics.median(r.ratio for r in rows), 3),
        "rows": [asdict(r) for r in rows],
    }
    print(f"median ratio constrained/unconstrained: {result['median_ratio']:.2f}")
    write_result(args.json_out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
