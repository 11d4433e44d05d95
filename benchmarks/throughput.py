"""Worker throughput: batching under concurrent clients, against one-at-a-time and `transformers serve`, plus
frame KV reuse and grammar cost — one run, same model, same requests.

    .venv/bin/python -m benchmarks.throughput [--fixture idefics3|minicpmv46 | --model PATH_OR_ID]
                                             [--json-out PATH] [--quick | --smoke]

Without --model it builds a tiny random test fixture into a temporary folder: Idefics3 (default) or MiniCPM-V 4.6
(`--fixture minicpmv46`: hybrid linear/full-attention text model). Parts:
 (i)   one request at a time: a worker started with --max-batch-size 1, one client sending sequentially;
 (ii)  the worker with batching (its default --max-batch-size 8: 16 clients make two batches that take turns,
       one preparing while the other generates) under 1, 4, 8 and 16 closed-loop clients. At 8 clients (the
       targets' level) (i) and (ii) are measured in alternating rounds (3 in a full run, each on new frames),
       both workers up at once, and each target is the median of the rounds' own ratios: the machine's speed
       drifts over a run, and a ratio of numbers taken minutes apart carries that drift;
 (iii) `transformers serve` on the same model, requests and client counts. It ignores `response_format`, so the
       worker is also measured on the same requests without it (the "free" rows): the like-for-like comparison;
 (iv)  a repeated frame: a new frame (cold), the same frame with another question (exact hit), the frame with a
       3x16-pixel cursor drawn (similar hit) — server-side time to first token and client total;
 (v)   per-token decode cost with and without DeskEye's JSON schema, at the same token count (the fastest of 3
       repeats of each request).
Every throughput request carries its own 800x600 screenshot, so frame KV reuse cannot flatter the batching rows.
All servers run with the same torch threads (--threads, default 1) and free-text requests generate a fixed
number of tokens (--max-tokens; random models rarely emit EOS). The batching rows also report the mean number of
rows the worker decoded per step (its decode_row_steps / decode_steps counters over the row), and every worker row
where its time went: the model thread's busy share, the share of that it ran on a core, and the process's CPU per
answer (from its /metrics). Prints tables, every target with MET / MISSED, and writes JSON (default
benchmarks/results/throughput-FIXTURE.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks._harness import (Endpoint, ServerPool, ServerUnavailable, dark_mode, deskeye_worker, fmt, median,
                                 percentile, render_screen, rounded, screen_png, to_png, transformers_serve,
                                 with_cursor)
from benchmarks._load import Reply, fetch_metrics, post_one, run_closed_loop
from benchmarks._results import write_result

RESULTS_DIR = Path("benchmarks/results")
FIXTURES = {"idefics3": ("build_tiny_idefics3", "tiny random Idefics3 (tests/fixtures)"),
            "minicpmv46": ("build_tiny_minicpmv46", "tiny random MiniCPM-V 4.6 (tests/fixtures, hybrid attention)")}
QUESTIONS = ("What is on this screen?", "Which window has focus, and what does it show?",
             "List the buttons you can see.", "Is there an error message on the screen?")
SERVE_OPTIONS = ("--continuous-batching",)
TARGET_CLIENTS = 8
TARGET_SPEEDUP = 4.0
TARGET_TTFT_SHARE = 1 / 3
TARGET_GRAMMAR_OVERHEAD = 0.05
TARGET_MEAN_LIVE_ROWS = 7.0


@dataclass(frozen=True)
class Plan:
    """How much one run measures."""
    num_requests: int                 # per throughput row
    levels: tuple[int, ...]           # concurrent clients per row
    num_frame_trials: int             # (iv)
    num_grammar_prompts: int          # (v)
    serve_skip_reason: str = ""       # non-empty: (iii) is not run, and this says why
    num_anchor_rounds: int = 3        # (i)/(ii) rounds at the anchor level, alternating the two workers

    def __post_init__(self):
        if not self.levels or min(self.levels) < 1 or self.num_requests < max(self.levels):
            raise ValueError(f"levels must be client counts >= 1, each at most num_requests={self.num_requests}; "
                             f"got {self.levels!r}.")
        if min(self.num_frame_trials, self.num_grammar_prompts, self.num_anchor_rounds) < 1:
            raise ValueError("num_frame_trials, num_grammar_prompts and num_anchor_rounds must be at least 1.")

    @property
    def anchor_clients(self) -> int:
        """The client count the targets compare at (8, or the largest level a short run has)."""
        return TARGET_CLIENTS if TARGET_CLIENTS in self.levels else max(self.levels)


PLANS = {
    "full": Plan(64, (1, 4, 8, 16), 8, 6),
    "quick": Plan(16, (1, 4, 8, 16), 4, 3, num_anchor_rounds=2),
    "smoke": Plan(4, (1, 4), 1, 1, serve_skip_reason="skipped in --smoke mode (its start-up alone takes ~10 s); "
                                                       "run without --smoke to compare", num_anchor_rounds=1),
}


@dataclass
class LoadRow:
    """One throughput row: a server, an output kind and a number of closed-loop clients."""
    part: str
    server: str
    output: str                       # "json" (DeskEye schema) | "free" (no response_format)
    num_clients: int
    num_requests: int
    num_ok: int
    wall_s: float
    requests_per_s: float
    tokens_per_s: float
    tokens_per_request: float
    p50_ms: float | None
    p95_ms: float | None
    mean_batch_size: float | None     # from deskeye.batch_size (None: the server does not report it)
    server_queue_p50_ms: float | None  # from deskeye.timing.queue_ms (arrival -> batch start, incl. the window)
    server_ttft_p50_ms: float | None  # from deskeye.timing.ttft_ms (batch start -> first token)
    mean_live_rows: float | None = None   # rows decoded per step over this row (the worker's counters)
    model_busy_share: float | None = None  # of the row's wall time, the share the model thread was in model calls
    model_on_cpu_share: float | None = None  # of that busy time, the share it ran (the rest: waiting, GIL or core)
    worker_cpu_ms_per_request: float | None = None  # the worker process's CPU (all its threads) per answer
    errors: list[str] = field(default_factory=list)
    round: int = 0                    # which anchor round (see the module docstring); 0 elsewhere


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help="model folder or Hub id (default: build a tiny fixture, see --fixture)")
    source.add_argument("--fixture", choices=sorted(FIXTURES), default="idefics3",
                        help="the tiny random fixture to build and measure (default idefics3)")
    parser.add_argument("--json-out", type=Path, default=None,
                        help="where the JSON goes (default benchmarks/results/throughput-FIXTURE.json)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="16 requests per row, fewer trials (~1 min)")
    size.add_argument("--smoke", action="store_true",
                      help="4 requests, clients 1 and 4, one trial, no transformers serve (for the test suite)")
    parser.add_argument("--vllm", action="store_true",
                        help="add the vLLM column (benchmarks/external_engines.py; needs .venv-vllm/)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every server (default 1)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"),
                        help="device of both servers (default cpu)")
    parser.add_argument("--max-batch-size", type=int, default=8,
                        help="the batching worker's --max-batch-size (default: the worker's default, 8)")
    parser.add_argument("--prepare-processes", type=int, default=0, metavar="N",
                        help="the batching worker's --prepare-processes (default 0: its preprocessing threads run "
                             "the processor; the --max-batch-size 1 worker always keeps the default)")
    parser.add_argument("--max-tokens", type=int, default=48,
                        help="tokens per free-text request (fixed, so both servers do the same work)")
    parser.add_argument("--json-max-tokens", type=int, default=256,
                        help="max_tokens of the DeskEye (JSON schema) requests (default: the app's 256)")
    parser.add_argument("--no-transformers-serve", action="store_true", help="leave out part (iii)")
    args = parser.parse_args(argv)
    if min(args.threads, args.max_batch_size, args.max_tokens, args.json_max_tokens) < 1:
        parser.error("--threads, --max-batch-size, --max-tokens and --json-max-tokens must be at least 1")
    if args.prepare_processes < 0:
        parser.error("--prepare-processes must be 0 (none) or more")
    if args.json_out is None:
        args.json_out = RESULTS_DIR / f"throughput-{'model' if args.model else args.fixture}.json"
    return args


def plan_for(args: argparse.Namespace) -> Plan:
    plan = PLANS["smoke" if args.smoke else "quick" if args.quick else "full"]
    if args.no_transformers_serve:
        plan = dataclasses.replace(plan, serve_skip_reason="skipped by --no-transformers-serve")
    return plan


# ---------------------------------------------------------------- requests

def chat_body(model: str, question: str, png: bytes, *, max_tokens: int, is_json: bool) -> dict:
    from deskeye.prompt import build_messages, deskeye_response_format
    body = {"model": model, "messages": build_messages(question, png), "max_tokens": max_tokens, "temperature": 0}
    if is_json:
        body["response_format"] = deskeye_response_format()
    return body


class RequestSets:
    """Encoded request bodies per (output kind, client count), built once, so the worker's free rows and
    `transformers serve` get byte-identical requests. Each request has its own frame; a free request's frame is
    the dark-mode (inverted) twin of the json request's, so no two requests to one worker share a frame."""

    def __init__(self, model: str, args: argparse.Namespace, num_requests: int):
        self.model = model
        self.args = args
        self.num_requests = num_requests
        self._bodies: dict[tuple[str, int, int], list[bytes]] = {}

    def get(self, output: str, num_clients: int, round_: int = 0) -> list[bytes]:
        """The bodies for `num_clients` clients; each anchor round `round_` > 0 has frames of its own."""
        if (output, num_clients, round_) not in self._bodies:
            self._build(num_clients, round_)
        return self._bodies[(output, num_clients, round_)]

    def build_all(self, levels: tuple[int, ...]) -> None:
        for num_clients in levels:
            self.get("json", num_clients)

    def body(self, output: str, seed: str, index: int = 0) -> dict:
        """One request about the frame rendered from `seed`."""
        return self.body_for_png(output, screen_png(seed), index)

    def body_for_png(self, output: str, png: bytes, index: int = 0) -> dict:
        is_json = output == "json"
        max_tokens = self.args.json_max_tokens if is_json else self.args.max_tokens
        return chat_body(self.model, QUESTIONS[index % len(QUESTIONS)], png, max_tokens=max_tokens,
                         is_json=is_json)

    def _build(self, num_clients: int, round_: int) -> None:
        json_bodies, free_bodies = [], []
        for index in range(self.num_requests):
            image = render_screen(f"load-{num_clients}-{index}" + (f"-round-{round_}" if round_ else ""))
            json_bodies.append(json.dumps(self.body_for_png("json", to_png(image), index)).encode())
            free_bodies.append(json.dumps(self.body_for_png("free", to_png(dark_mode(image)), index)).encode())
        self._bodies[("json", num_clients, round_)] = json_bodies
        self._bodies[("free", num_clients, round_)] = free_bodies


def warm_up(endpoint: Endpoint, requests: RequestSets) -> None:
    """One request of each kind (loads lazily built parts such as the grammar compiler); not measured."""
    for output in ("json", "free"):
        reply = post_one(endpoint, requests.body(output, f"warm-up-{output}"))
        if not reply.is_ok:
            print(f"warning: warm-up {output} request to {endpoint.name} failed: {reply.error}")


# ---------------------------------------------------------------- (i) (ii) (iii) throughput

def measure_load(part: str, endpoint: Endpoint, output: str, bodies: list[bytes], num_clients: int,
                 round_: int = 0) -> tuple[LoadRow, list[Reply]]:
    before = fetch_metrics(endpoint)
    replies, wall_s = run_closed_loop(endpoint, bodies, num_clients)
    after = fetch_metrics(endpoint)
    ok = [r for r in replies if r.is_ok]
    tokens = sum(r.completion_tokens for r in ok)
    batch_sizes = [r.deskeye["batch_size"] for r in ok if isinstance(r.deskeye.get("batch_size"), int)]
    latencies = [r.wall_ms for r in ok]
    row = LoadRow(
        part=part, server=endpoint.name, output=output, num_clients=num_clients, num_requests=len(bodies),
        num_ok=len(ok), wall_s=round(wall_s, 3), requests_per_s=round(len(ok) / wall_s, 3),
        tokens_per_s=round(tokens / wall_s, 1), tokens_per_request=round(tokens / max(1, len(ok)), 1),
        p50_ms=rounded(median(latencies), 1), p95_ms=rounded(percentile(latencies, 0.95), 1),
        mean_batch_size=rounded(sum(batch_sizes) / len(batch_sizes), 2) if batch_sizes else None,
        server_queue_p50_ms=rounded(median(timings_ms(ok, "queue_ms")), 1),
        server_ttft_p50_ms=rounded(median(timings_ms(ok, "ttft_ms")), 1),
        mean_live_rows=mean_live_rows(before, after), **model_thread_use(before, after, wall_s, len(ok)),
        errors=sorted({f"HTTP {r.status}: {r.error[:200]}" for r in replies if not r.is_ok})[:3], round=round_)
    print(f"  {part} {endpoint.name:<26} {output:<4} {num_clients:>2} clients: {row.requests_per_s:.2f} req/s, "
          f"{row.num_ok}/{row.num_requests} ok in {wall_s:.1f} s" + (f" (round {round_})" if round_ else ""))
    return row, replies


def mean_live_rows(before: dict | None, after: dict | None) -> float | None:
    """Rows decoded per decode step between two /metrics readings (None: the server does not count them)."""
    keys = ("deskeye_worker_decode_steps_total", "deskeye_worker_decode_row_steps_total")
    if before is None or after is None or not all(k in after for k in keys):
        return None
    steps, row_steps = (after[k] - before.get(k, 0.0) for k in keys)
    return round(row_steps / steps, 2) if steps > 0 else None


MODEL_BUSY_S = "deskeye_worker_model_busy_seconds_total"
MODEL_CPU_S = "deskeye_worker_model_cpu_seconds_total"
PROCESS_CPU_S = "process_cpu_seconds_total"


def model_thread_use(before: dict | None, after: dict | None, wall_s: float, num_ok: int) -> dict:
    """Where the row's time went in the worker, from two /metrics readings: the model thread's busy share of the
    wall time, the share of that it was on a core, and the process's CPU per answer (None where not reported)."""
    def delta(key: str) -> float | None:
        if before is None or after is None or key not in after:
            return None
        return after[key] - before.get(key, 0.0)
    busy_s, cpu_s, process_s = delta(MODEL_BUSY_S), delta(MODEL_CPU_S), delta(PROCESS_CPU_S)
    return {"model_busy_share": rounded(busy_s / wall_s, 3) if busy_s is not None and wall_s > 0 else None,
            "model_on_cpu_share": rounded(cpu_s / busy_s, 3) if cpu_s is not None and busy_s else None,
            "worker_cpu_ms_per_request": rounded(1000 * process_s / num_ok, 1) if process_s is not None and num_ok
            else None}


def timings_ms(replies: list[Reply], name: str) -> list[float]:
    """deskeye.timing[name] of the replies that report it."""
    return [t for t in (r.timing_ms(name) for r in replies) if t is not None]


ANCHOR_PARTS = {"single": ("(i)", 1), "batched": ("(ii)", None)}      # None: the anchor client count


def measure_anchor(servers: ServerPool, plan: Plan, requests: RequestSets, names: tuple[str, ...],
                   ) -> tuple[list[LoadRow], list[Reply]]:
    """(i) and/or (ii) (`names`: "single", "batched") at the anchor level, `plan.num_anchor_rounds` rounds of json
    then free, each round on frames of its own; with both names the two workers take turns within every round.
    Returns the rows and the batching worker's free replies of round 0 (to compare texts)."""
    n, rows, free_replies = plan.anchor_clients, [], []
    for round_ in range(plan.num_anchor_rounds):
        for output in ("json", "free"):
            bodies = requests.get(output, n, round_)
            for name in names:
                part, clients = ANCHOR_PARTS[name]
                row, replies = measure_load(part, servers.endpoint(name), output, bodies, clients or n, round_)
                rows.append(row)
                if name == "batched" and output == "free" and round_ == 0:
                    free_replies = replies
    return rows, free_replies


def measure_single(servers: ServerPool, plan: Plan, requests: RequestSets, *, interleave: bool,
                   ) -> tuple[list[LoadRow], list[Reply], dict, dict]:
    """(i) and, interleaved with it, (ii) at the anchor level; then (iv) and (v) on the --max-batch-size 1 worker."""
    single = servers.endpoint("single")
    warm_up(single, requests)
    if interleave:
        warm_up(servers.endpoint("batched"), requests)
    rows, free_replies = measure_anchor(servers, plan, requests, ("single", "batched") if interleave else ("single",))
    repeated = measure_repeated_frame(single, requests, plan.num_frame_trials)
    return rows, free_replies, repeated, measure_grammar(single, requests, plan.num_grammar_prompts)


def measure_batched(servers: ServerPool, plan: Plan, requests: RequestSets, *, interleave: bool,
                    anchor_free: list[Reply]) -> tuple[list[LoadRow], dict[int, list[Reply]]]:
    """(ii) at the other client counts (and at the anchor level too when not interleaved); also returns its
    free-text replies per client count (to compare texts)."""
    batched = servers.endpoint("batched")
    rows: list[LoadRow] = []
    if not interleave:
        warm_up(batched, requests)
        rows, anchor_free = measure_anchor(servers, plan, requests, ("batched",))
    free_replies = {plan.anchor_clients: anchor_free}
    for output in ("json", "free"):
        for num_clients in (n for n in plan.levels if n != plan.anchor_clients):
            row, replies = measure_load("(ii)", batched, output, requests.get(output, num_clients), num_clients)
            rows.append(row)
            if output == "free":
                free_replies[num_clients] = replies
    return rows, free_replies


def measure_serve(servers: ServerPool, model: str, args: argparse.Namespace, plan: Plan, requests: RequestSets,
                  worker_free: dict[int, list[Reply]]) -> tuple[list[LoadRow], dict]:
    """(iii): `transformers serve` on the free-text request sets; what it is and what it did, or why not."""
    info: dict = {"available": False, "reason": plan.serve_skip_reason, "options": list(SERVE_OPTIONS),
                  "env": {"OMP_NUM_THREADS": str(args.threads)}}
    if plan.serve_skip_reason:
        return [], info
    rows: list[LoadRow] = []
    try:
        serve = servers.endpoint("serve")
        info.update(probe_serve(serve, requests))
        for num_clients in plan.levels:
            row, replies = measure_load("(iii)", serve, "free", requests.get("free", num_clients), num_clients)
            rows.append(row)
            info.setdefault("same_text_as_worker", {})[str(num_clients)] = same_text(replies, worker_free[num_clients])
        info.update(serve_log_facts(serve.log_text()), available=True, reason="")
    except ServerUnavailable as exc:
        info["reason"] = f"transformers serve cannot serve {model}: {exc}"
    return rows, info


def server_factories(model: str, work_dir: Path, args: argparse.Namespace, plan: Plan) -> dict:
    options = dict(num_threads=args.threads, device=args.device)
    factories = {
        "single": lambda: deskeye_worker(model, work_dir / "worker-bs1", max_batch_size=1, **options),
        "batched": lambda: deskeye_worker(model, work_dir / "worker-batched", max_batch_size=args.max_batch_size,
                                          extra_args=prepare_args(args.prepare_processes), **options),
    }
    if not plan.serve_skip_reason:
        factories["serve"] = lambda: transformers_serve(model, work_dir / "transformers-serve",
                                                        options=SERVE_OPTIONS, **options)
    return factories


def prepare_args(num_processes: int) -> tuple[str, ...]:
    return ("--prepare-processes", str(num_processes)) if num_processes else ()


def measure_all(model: str, work_dir: Path, args: argparse.Namespace, plan: Plan, requests: RequestSets,
                *, start_together: bool) -> dict:
    """Every part; servers start together (the fixture: then the anchor rounds alternate the two workers) or
    each in turn (a real model: one worker after the other)."""
    with ServerPool(server_factories(model, work_dir, args, plan), num_threads=args.threads) as servers:
        if start_together:
            servers.start_all(while_waiting=lambda: requests.build_all(plan.levels))
        rows, anchor_free, repeated, grammar = measure_single(servers, plan, requests, interleave=start_together)
        servers.stop("single")
        batched_rows, worker_free = measure_batched(servers, plan, requests, interleave=start_together,
                                                    anchor_free=anchor_free)
        servers.stop("batched")
        serve_rows, serve_info = measure_serve(servers, model, args, plan, requests, worker_free)
    return {"rows": rows + batched_rows + serve_rows, "repeated": repeated, "grammar": grammar,
            "serve": serve_info}


def measure_model_only(model: str, args: argparse.Namespace, plan: Plan, requests: RequestSets,
                       num_repeats: int = 3) -> dict:
    """Where the ceiling is: the engine alone in this process, on the anchor level's JSON requests already
    prepared (no HTTP, no image decoding, no processor on the clock): one at a time vs as one batch."""
    from inference_worker.engines import EngineOptions, load_hf_engine
    from inference_worker.protocol import parse_chat_request

    engine = load_hf_engine(model, EngineOptions(device=args.device, num_threads=args.threads), progress=False)
    try:
        requests_ = [parse_chat_request(json.loads(body)) for body in requests.get("json", plan.anchor_clients)]
        prepared = [engine.prepare(r) for r in requests_[:plan.anchor_clients]]
        run = lambda items: engine.run_batch(items, lambda index, answer: None)   # noqa: E731
        run(prepared[:2])                                                           # warm-up
        alone, together = [], []
        for _ in range(num_repeats):
            alone.append(_seconds(lambda: [run([item]) for item in prepared]))
            together.append(_seconds(lambda: run(prepared)))
    finally:
        engine.close()
    return {"num_requests": len(prepared), "one_at_a_time_ms": round(median(alone) * 1000, 1),
            "batched_ms": round(median(together) * 1000, 1), "ratio": round(median(alone) / median(together), 2)}


def _seconds(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def probe_serve(serve: Endpoint, requests: RequestSets) -> dict:
    """Does it answer, honour max_tokens and temperature 0, and what does it do with response_format?"""
    free = requests.body("free", "serve-probe")
    first, second = post_one(serve, free), post_one(serve, free)
    if not first.is_ok:
        raise ServerUnavailable(f"its first request failed: HTTP {first.status} {first.error}")
    constrained = post_one(serve, requests.body("json", "serve-probe"))
    return {
        "honours_max_tokens": first.completion_tokens == free["max_tokens"],
        "probe_completion_tokens": first.completion_tokens, "probe_max_tokens": free["max_tokens"],
        "greedy_repeatable": first.content == second.content,
        "response_format_answer_is_schema_json": is_deskeye_json(constrained),
    }


def is_deskeye_json(reply: Reply) -> bool:
    from deskeye.prompt import parse_description
    try:
        parse_description(reply.content)
    except ValueError:
        return False
    return True


def same_text(replies: list[Reply], reference: list[Reply]) -> str:
    """'k/n': how many answers equal the worker's answer to the same request (greedy, same model)."""
    pairs = [(a, b) for a, b in zip(replies, reference) if a.is_ok and b.is_ok]
    return f"{sum(a.content == b.content for a, b in pairs)}/{len(pairs)}"


def serve_log_facts(log: str) -> dict:
    lines = log.splitlines()
    return {
        "continuous_batching_used": any("CB: True" in line for line in lines),
        "continuous_batching_note": next((line.strip() for line in lines if "continuous batching" in line), ""),
        "ignored_fields_note": next((line.strip() for line in lines if "Ignoring unsupported fields" in line), ""),
    }


# ---------------------------------------------------------------- (iv) repeated frame

def measure_repeated_frame(endpoint: Endpoint, requests: RequestSets, num_trials: int) -> dict:
    """Per trial: a new frame (cold), the same frame again (exact), the frame with a cursor drawn (similar)."""
    replies: dict[str, list[Reply]] = {"cold": [], "exact": [], "similar": []}
    for trial in range(num_trials):
        image = render_screen(f"repeated-frame-{trial}")
        frame, similar = to_png(image), to_png(with_cursor(image))
        for question_index, (case, png) in enumerate((("cold", frame), ("exact", frame), ("similar", similar))):
            replies[case].append(post_one(endpoint, requests.body_for_png("free", png, question_index)))
    cases = {case: frame_case(case_replies) for case, case_replies in replies.items()}
    print(f"  (iv) {endpoint.name}: {num_trials} trials x cold/exact/similar done")
    return {"server": endpoint.name, "num_trials": num_trials, "output": "free", "cases": cases,
            "exact_vs_cold_ttft": ratio(cases["exact"]["ttft_p50_ms"], cases["cold"]["ttft_p50_ms"]),
            "similar_vs_cold_ttft": ratio(cases["similar"]["ttft_p50_ms"], cases["cold"]["ttft_p50_ms"])}


def frame_case(replies: list[Reply]) -> dict:
    ok = [r for r in replies if r.is_ok]
    kv_counts: dict[str, int] = {}
    for reply in ok:
        level = str(reply.deskeye.get("kv_cache", "n/a"))
        kv_counts[level] = kv_counts.get(level, 0) + 1
    return {
        "num_ok": len(ok), "num_requests": len(replies), "kv_cache": kv_counts,
        "ttft_p50_ms": rounded(median(timings_ms(ok, "ttft_ms")), 2),
        "server_total_p50_ms": rounded(median(timings_ms(ok, "total_ms")), 2),
        "client_total_p50_ms": rounded(median([r.wall_ms for r in ok]), 2),
        "tokens_per_request": rounded(sum(r.completion_tokens for r in ok) / max(1, len(ok)), 1),
    }


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else round(numerator / denominator, 3)


# ---------------------------------------------------------------- (v) grammar cost

GRAMMAR_REPEATS = 3        # (v): each prompt's free and JSON requests are sent this many times, in alternating order


def measure_grammar(endpoint: Endpoint, requests: RequestSets, num_prompts: int) -> dict:
    """Per prompt: the JSON request once (cold; learns its token count n), then free text with max_tokens=n and
    the JSON request again, GRAMMAR_REPEATS times in alternating order — all of those reuse the frame's prefix
    alike and decode the same number of tokens. Each request's fastest repeat stands for it (the machine's noise
    only ever adds time), then the median over prompts."""
    pairs: list[tuple[Reply, Reply]] = []
    for index in range(num_prompts):
        png = screen_png(f"grammar-{index}")
        constrained = requests.body_for_png("json", png, index)
        first = post_one(endpoint, constrained)
        if not first.is_ok or first.completion_tokens < 1:
            print(f"warning: grammar prompt {index} failed: HTTP {first.status} {first.error[:200]}")
            continue
        free = {**requests.body_for_png("free", png, index), "max_tokens": first.completion_tokens}
        pairs.append(fastest_pair(endpoint, free, constrained))
    kinds = {"free": [p[0] for p in pairs], "json": [p[1] for p in pairs]}
    print(f"  (v) {endpoint.name}: {len(pairs)}/{num_prompts} prompt pairs done")
    costs = {kind: per_token_costs([r for r in replies if r.is_ok]) for kind, replies in kinds.items()}
    server_ratio = ratio(costs["json"]["server_decode_ms_per_token"], costs["free"]["server_decode_ms_per_token"])
    return {"server": endpoint.name, "num_prompts": num_prompts, "num_pairs": len(pairs),
            "repeats_per_request": GRAMMAR_REPEATS, **costs, "server_ratio": server_ratio,
            "client_ratio": ratio(costs["json"]["client_ms_per_token"], costs["free"]["client_ms_per_token"])}


def fastest_pair(endpoint: Endpoint, free: dict, constrained: dict) -> tuple[Reply, Reply]:
    """The free and the JSON request GRAMMAR_REPEATS times each (free first, then JSON first, ...); for each,
    the reply that decoded fastest (an answer that failed counts as it is)."""
    replies: dict[str, list[Reply]] = {"free": [], "json": []}
    for repeat in range(GRAMMAR_REPEATS):
        order = (("free", free), ("json", constrained)) if repeat % 2 == 0 else (("json", constrained), ("free", free))
        for kind, body in order:
            replies[kind].append(post_one(endpoint, body))
    return tuple(min(replies[kind], key=_decode_ms_or_inf) for kind in ("free", "json"))


def _decode_ms_or_inf(reply: Reply) -> float:
    decode_ms = reply.timing_ms("decode_ms") if reply.is_ok else None
    return decode_ms if decode_ms is not None else float("inf")


def per_token_costs(replies: list[Reply]) -> dict:
    decode = [r.timing_ms("decode_ms") / r.completion_tokens for r in replies
              if r.timing_ms("decode_ms") is not None and r.completion_tokens]
    masks = [r.deskeye["grammar_ms"] / r.completion_tokens for r in replies
             if isinstance(r.deskeye.get("grammar_ms"), (int, float)) and r.completion_tokens]
    return {
        "num_ok": len(replies),
        "tokens_per_request": rounded(sum(r.completion_tokens for r in replies) / max(1, len(replies)), 1),
        "server_decode_ms_per_token": rounded(median(decode), 4),
        "client_ms_per_token": rounded(median([r.wall_ms / r.completion_tokens for r in replies
                                               if r.completion_tokens]), 4),
        "grammar_mask_ms_per_token": rounded(median(masks), 4),
    }


# ---------------------------------------------------------------- targets and report

def find_row(rows: list[LoadRow], part: str, output: str, num_clients: int) -> LoadRow | None:
    """The row (round 0 where there are rounds)."""
    return next((r for r in rows if (r.part, r.output, r.num_clients) == (part, output, num_clients)), None)


def round_rows(rows: list[LoadRow], part: str, output: str, num_clients: int) -> dict[int, LoadRow]:
    return {r.round: r for r in rows if (r.part, r.output, r.num_clients) == (part, output, num_clients)}


def speedup_over_rounds(rows: list[LoadRow], output: str, num_clients: int
                        ) -> tuple[float | None, float | None, float | None]:
    """(median (ii) req/s, median (i) req/s, median of the rounds' own (ii)/(i) ratios)."""
    single, batched = round_rows(rows, "(i)", output, 1), round_rows(rows, "(ii)", output, num_clients)
    pairs = [(batched[k].requests_per_s, single[k].requests_per_s) for k in sorted(single.keys() & batched.keys())
             if single[k].requests_per_s]
    if not pairs:
        return None, None, None
    return (median([b for b, _ in pairs]), median([s for _, s in pairs]),
            round(median([b / s for b, s in pairs]), 3))


def targets(rows: list[LoadRow], plan: Plan, repeated: dict, grammar: dict) -> list[dict]:
    n = plan.anchor_clients
    found = []
    for output in ("json", "free"):
        batched_rps, single_rps, speedup = speedup_over_rounds(rows, output, n)
        found.append(target(f"{n} clients >= {TARGET_SPEEDUP:g}x one-at-a-time ({output} requests, req/s; "
                            f"median of {plan.num_anchor_rounds} rounds' ratios)",
                            batched_rps, single_rps, TARGET_SPEEDUP, higher_is_better=True, value=speedup))
    for output in ("json", "free"):
        live = [r.mean_live_rows for r in round_rows(rows, "(ii)", output, n).values() if r.mean_live_rows is not None]
        found.append(target(f"mean live rows >= {TARGET_MEAN_LIVE_ROWS:g} at {n} clients ({output} requests, "
                            "median of the rounds)", median(live) if live else None, 1.0, TARGET_MEAN_LIVE_ROWS,
                            higher_is_better=True))
    batched, serve = find_row(rows, "(ii)", "free", n), find_row(rows, "(iii)", "free", n)
    found.append(target(f"{n} clients >= transformers serve under the same load (free requests, req/s)",
                        batched and batched.requests_per_s, serve and serve.requests_per_s, 1.0,
                        higher_is_better=True))
    found.append(target("exact-hit TTFT <= 1/3 of cold (server ttft_ms p50)",
                        repeated["cases"]["exact"]["ttft_p50_ms"], repeated["cases"]["cold"]["ttft_p50_ms"],
                        TARGET_TTFT_SHARE, higher_is_better=False))
    found.append(target("grammar overhead <= 5% per token (server decode ms/token, json / free)",
                        grammar["json"]["server_decode_ms_per_token"], grammar["free"]["server_decode_ms_per_token"],
                        1 + TARGET_GRAMMAR_OVERHEAD, higher_is_better=False))
    return found


def target(name: str, measured: float | None, baseline: float | None, goal: float, *,
           higher_is_better: bool, value: float | None = None) -> dict:
    """`value`: the ratio when it is not measured / baseline (a median of paired ratios)."""
    value = ratio(measured, baseline) if value is None else value
    met = None if value is None else (value >= goal if higher_is_better else value <= goal)
    return {"target": name, "measured": measured, "baseline": baseline, "ratio": value,
            "goal": f"{'>=' if higher_is_better else '<='} {goal:.3g}", "met": met}


def print_report(report: dict) -> None:
    print(f"\nmodel: {report['model']}  device: {report['device']}  torch threads per server: {report['threads']}  "
          f"batching worker --max-batch-size {report['max_batch_size']} "
          f"--prepare-processes {report.get('prepare_processes', 0)}")
    print(f"free requests: max_tokens={report['max_tokens']} (fixed work); json requests: DeskEye schema, "
          f"max_tokens={report['json_max_tokens']}; every request has its own 800x600 frame (no KV reuse between "
          f"them); {report['num_requests']} requests per row, closed-loop clients\n")
    header = (f"{'part':<7}{'server':<27}{'output':<7}{'clients':>7}{'ok':>7}{'req/s':>8}{'tok/s':>8}{'tok/req':>8}"
              f"{'p50 ms':>9}{'p95 ms':>9}{'batch':>7}{'live':>6}{'queue ms':>9}{'ttft ms':>9}{'busy':>6}{'run':>6}"
              f"{'cpu ms':>8}")
    print(header)
    print("-" * len(header))
    for r in report["throughput"]:
        part = f"{r['part']}#{r['round']}" if r.get("round") else r["part"]
        print(f"{part:<7}{r['server'][:26]:<27}{r['output']:<7}{r['num_clients']:>7}"
              f"{r['num_ok']:>4}/{r['num_requests']:<2}{r['requests_per_s']:>8.2f}{r['tokens_per_s']:>8.0f}"
              f"{r['tokens_per_request']:>8.1f}{fmt(r['p50_ms']):>9}{fmt(r['p95_ms']):>9}"
              f"{fmt(r['mean_batch_size'], 2):>7}{fmt(r['mean_live_rows'], 2):>6}{fmt(r['server_queue_p50_ms']):>9}"
              f"{fmt(r['server_ttft_p50_ms']):>9}{fmt(r.get('model_busy_share'), 2):>6}"
              f"{fmt(r.get('model_on_cpu_share'), 2):>6}{fmt(r.get('worker_cpu_ms_per_request')):>8}")
        for error in r["errors"]:
            print(f"      error: {error}")
    print(f"(i) = worker --max-batch-size 1, one client sending sequentially, on the requests of the "
          f"{report['anchor_clients']}-client rows (#k: anchor round k, alternating with (ii), new frames each round); "
          "free = the same kind of requests without response_format "
          "(transformers serve ignores it, so the free rows are the like-for-like comparison); p50/p95 = client "
          "latency; batch (most rows decoded with each request), queue ms (arrival -> its decode) and ttft ms "
          "(joining the decode -> first token) come from the worker's deskeye fields (p50); live = rows decoded per "
          "step over the row; busy = share of the row's time the model thread spent in model calls, run = share of "
          "that it was on a core (the rest it waited for the GIL or a core), cpu ms = the worker process's CPU per "
          "answer, its --prepare-processes children not included (the worker's /metrics counters)")
    print_model_only(report["model_only"])
    print_serve(report["transformers_serve"])
    print_repeated(report["repeated_frame"])
    print_grammar(report["grammar"])
    print_targets(report["targets"])


def print_model_only(info: dict) -> None:
    print(f"\n(ii) model only, in this process, {info['num_requests']} prepared JSON requests: one at a time "
          f"{info['one_at_a_time_ms']} ms, as one batch {info['batched_ms']} ms -> {info['ratio']}x. The end-to-end "
          "rows also pay HTTP, image decoding and the processor for every request, on the same cores.")


def print_serve(info: dict) -> None:
    print(f"\n(iii) transformers serve: {'measured' if info['available'] else 'not measured: ' + info['reason']}")
    if not info["available"]:
        return
    print(f"  options {' '.join(info['options'])}, OMP_NUM_THREADS={info['env']['OMP_NUM_THREADS']}; "
          f"continuous batching used: {info['continuous_batching_used']} ({info['continuous_batching_note'] or '-'})")
    print(f"  honours max_tokens: {info['honours_max_tokens']} ({info['probe_completion_tokens']}/"
          f"{info['probe_max_tokens']} tokens); temperature 0 repeatable: {info['greedy_repeatable']}; "
          f"response_format answer is schema JSON: {info['response_format_answer_is_schema_json']} "
          f"({info['ignored_fields_note'] or 'no ignore note in its log'})")
    print(f"  same answer text as the batching worker, per client count: {info.get('same_text_as_worker', {})}")


def print_repeated(result: dict) -> None:
    print(f"\n(iv) repeated frame on {result['server']}, {result['num_trials']} trials, free text "
          "(cold = new frame, exact = same frame + other question, similar = frame + 3x16 px cursor)")
    print(f"  {'case':<9}{'kv_cache':<24}{'ttft p50':>10}{'server total':>14}{'client total':>14}{'tok/req':>9}")
    for case, c in result["cases"].items():
        kv = ", ".join(f"{k} {v}/{c['num_requests']}" for k, v in c["kv_cache"].items()) or "n/a"
        print(f"  {case:<9}{kv:<24}{fmt(c['ttft_p50_ms'], 2):>10}{fmt(c['server_total_p50_ms'], 2):>14}"
              f"{fmt(c['client_total_p50_ms'], 2):>14}{fmt(c['tokens_per_request']):>9}")
    print(f"  ttft exact/cold: {fmt(result['exact_vs_cold_ttft'], 3)}  similar/cold: "
          f"{fmt(result['similar_vs_cold_ttft'], 3)}")


def print_grammar(result: dict) -> None:
    print(f"\n(v) grammar cost on {result['server']}, {result['num_pairs']} prompt pairs, same token count, "
          f"the fastest of {result.get('repeats_per_request', 1)} repeats of each request")
    print(f"  {'output':<7}{'tok/req':>9}{'server decode ms/tok':>22}{'client ms/tok':>15}{'mask ms/tok':>13}")
    for kind in ("free", "json"):
        c = result[kind]
        print(f"  {kind:<7}{fmt(c['tokens_per_request']):>9}{fmt(c['server_decode_ms_per_token'], 3):>22}"
              f"{fmt(c['client_ms_per_token'], 3):>15}{fmt(c['grammar_mask_ms_per_token'], 3):>13}")
    print(f"  ratio json/free: server {fmt(result['server_ratio'], 3)}, client {fmt(result['client_ratio'], 3)}")


def print_targets(found: list[dict]) -> None:
    print("\ntargets (issues 3 and 12)")
    for t in found:
        verdict = {True: "MET", False: "MISSED", None: "n/a"}[t["met"]]
        print(f"  {verdict:<7}{t['target']}: {fmt(t['measured'], 2)} vs {fmt(t['baseline'], 2)} -> ratio "
              f"{fmt(t['ratio'], 3)} (goal {t['goal']})")


def environment() -> dict:
    import torch
    import transformers
    return {"torch": torch.__version__, "transformers": transformers.__version__, "cpu_count": os.cpu_count()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = plan_for(args)
    with tempfile.TemporaryDirectory(prefix="deskeye-throughput-") as tmp:
        work_dir = Path(tmp)
        model = args.model
        if model is None:
            from tests.fixtures import tiny_models
            builder = getattr(tiny_models, FIXTURES[args.fixture][0])
            model = str(builder(work_dir / f"tiny_{args.fixture}"))
        requests = RequestSets(model, args, plan.num_requests)
        measured = measure_all(model, work_dir, args, plan, requests, start_together=args.model is None)
        model_only = measure_model_only(model, args, plan, requests)
    rows, repeated, grammar = measured["rows"], measured["repeated"], measured["grammar"]
    report = {
        "benchmark": "throughput", "model": args.model or FIXTURES[args.fixture][1],
        "device": args.device, "threads": args.threads, "max_batch_size": args.max_batch_size,
        "prepare_processes": args.prepare_processes, "max_tokens": args.max_tokens,
        "json_max_tokens": args.json_max_tokens, "num_requests": plan.num_requests,
        "levels": list(plan.levels), "anchor_clients": plan.anchor_clients, **environment(),
        "servers_started": "together" if args.model is None else "one at a time",
        "throughput": [asdict(r) for r in rows], "transformers_serve": measured["serve"],
        "repeated_frame": repeated, "grammar": grammar, "model_only": model_only,
        "targets": targets(rows, plan, repeated, grammar),
    }
    if args.vllm:                        # DeskEye's worker beside vLLM, same model and load
        from benchmarks import external_engines
        report["external_engines"] = external_engines.run(max(plan.num_requests, max(external_engines.LEVELS)))
    print_report(report)
    if args.vllm:
        external_engines.print_table(report["external_engines"])
    print()
    write_result(args.json_out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
