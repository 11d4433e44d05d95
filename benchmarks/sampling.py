"""What drawing one sampled token costs at the real vocabularies' sizes: the old way (sort all the logits for
top-p, then a draw over all of them) beside the worker's (top-p over the most likely candidates only, growing
while they hold less than top_p; the draw over the kept ones), on one core and on the worker's threads.

    .venv/bin/python -m benchmarks.sampling [--steps 200] [--json-out PATH]

Logits: "peaked" (a trained model's next token: normal, sd 6, a few tokens hold most of the mass) and "flat"
(random weights: sd 0.05, the mass spread over the whole vocabulary - the candidates must grow to all of it).
Settings: top_p 0.9 alone, top_k 50 with top_p 0.9, and temperature alone. Greedy requests (DeskEye's own) take
the argmax and pay neither. Each configuration's draws are checked to stay inside the set the full sort keeps.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from benchmarks._results import write_result

DEFAULT_JSON_OUT = Path("benchmarks/results/sampling.json")
VOCABS = {"Qwen3 (MiniCPM-o 4.5)": 151_936, "Qwen3.5 (MiniCPM-V 4.6)": 248_094}
SETTINGS = {"top_p 0.9": (0, 0.9), "top_k 50, top_p 0.9": (50, 0.9), "temperature only": (0, 1.0)}
KINDS = {"peaked": 6.0, "flat": 0.05}
SEED = 5


def old_sample(torch, scores, top_k: int, top_p: float, generator) -> int:
    """The sampler as it was: top-k by threshold, top-p by sorting every logit, the draw over the vocabulary."""
    if top_k:
        kth = torch.topk(scores, min(top_k, scores.shape[-1])).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative - torch.softmax(sorted_scores, dim=-1) >= top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator))


def time_ms(call, steps: int) -> float:
    call()                                                   # warm
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        call()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def measure(steps: int, threads: int) -> list[dict]:
    import torch

    from inference_worker.engines.hf.sampling import TokenSampler, candidates
    from inference_worker.protocol import SamplingParams

    torch.set_num_threads(threads)
    rows = []
    for vocab_name, size in VOCABS.items():
        for kind, spread in KINDS.items():
            generator = torch.Generator().manual_seed(SEED)
            logits = torch.randn(size, generator=generator) * spread
            for setting, (top_k, top_p) in SETTINGS.items():
                sampler = TokenSampler(SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, seed=SEED))
                _, kept_ids = candidates(logits - logits.max(), top_k=top_k, top_p=top_p)
                old_generator = torch.Generator().manual_seed(SEED)
                old_kept = {old_sample(torch, logits - logits.max(), top_k, top_p, old_generator) for _ in range(20)}
                new_kept = {sampler.sample(logits) for _ in range(20)}
                allowed = None if kept_ids is None else set(kept_ids.tolist())
                if allowed is not None and not new_kept <= allowed:
                    raise AssertionError(f"{vocab_name} {kind} {setting}: a draw outside the kept set")
                old_ms = time_ms(lambda: old_sample(torch, logits - logits.max(), top_k, top_p, generator), steps)
                new_ms = time_ms(lambda: sampler.sample(logits), steps)
                rows.append(dict(vocab=vocab_name, vocab_size=size, logits=kind, setting=setting, threads=threads,
                                 num_kept=size if kept_ids is None else len(kept_ids), old_ms=round(old_ms, 3),
                                 new_ms=round(new_ms, 3), speedup=round(old_ms / new_ms, 1),
                                 old_distinct_draws=len(old_kept), new_distinct_draws=len(new_kept)))
    return rows


def print_table(rows: list[dict]) -> None:
    print("| vocabulary | logits | setting | threads | tokens kept | old ms/token | new ms/token | speed-up |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['vocab']} | {r['logits']} | {r['setting']} | {r['threads']} | {r['num_kept']:,} | "
              f"{r['old_ms']:.2f} | {r['new_ms']:.2f} | {r['speedup']}x |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="draws timed per configuration (median)")
    parser.add_argument("--json-out", type=Path, default=DEFAULT_JSON_OUT)
    args = parser.parse_args(argv)
    import os

    import torch
    num_threads = torch.get_num_threads()
    rows = [row for threads in sorted({1, num_threads}) for row in measure(args.steps, threads)]
    print_table(rows)
    write_result(args.json_out, {"cpu_count": os.cpu_count(), "steps": args.steps, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
