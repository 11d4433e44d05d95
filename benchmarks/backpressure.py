"""Back-pressure and streaming of the worker's HTTP layer, side by side in one run on the same model.

    .venv/bin/python -m benchmarks.backpressure [--model PATH_OR_ID] [--clients N] [--json-out PATH]

Without --model it builds the tiny random Idefics3 test fixture. Parts:
 (i)  a burst of N clients (default 32), one request each on its own connection, all released together, against
      a worker whose queue is effectively unbounded (--max-queue 100000, what the worker did before) and one with
      --max-queue 8: connect time, latency of the answered requests (p50/p99), how many got 503 + Retry-After;
 (ii) one 256-token request streamed (stream=true) against the same request whole: time to the first content
      chunk vs time to the whole answer.
Prints a table and writes JSON to benchmarks/results/backpressure.json.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks._harness import deskeye_worker, fmt, median, percentile, screen_png
from benchmarks._results import write_result

DEFAULT_JSON_OUT = Path("benchmarks/results/backpressure.json")
UNBOUNDED_QUEUE = 100_000
BOUNDED_QUEUE = 8
MAX_TOKENS = 32
STREAM_MAX_TOKENS = 256


def request_body(index: int, *, stream: bool = False, max_tokens: int = MAX_TOKENS) -> bytes:
    import base64
    png = base64.b64encode(screen_png(f"burst-{index}")).decode()
    return json.dumps({"model": "deskeye", "max_tokens": max_tokens, "temperature": 0, "stream": stream,
                       "messages": [{"role": "user", "content": [
                           {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
                           {"type": "text", "text": f"What is on this screen? #{index}"}]}]}).encode()


def one_request(endpoint, body: bytes, start: threading.Barrier) -> dict:
    start.wait()
    started_s = time.perf_counter()
    sock = socket.create_connection((endpoint.host, endpoint.port), timeout=300)
    connect_s = time.perf_counter() - started_s
    conn = http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=300)
    conn.sock = sock
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers=endpoint.headers())
        response = conn.getresponse()
        response.read()
        return {"status": response.status, "connect_s": connect_s, "total_s": time.perf_counter() - started_s,
                "retry_after": response.getheader("Retry-After")}
    finally:
        conn.close()


def burst(endpoint, num_clients: int) -> dict:
    bodies = [request_body(i) for i in range(num_clients)]
    start = threading.Barrier(num_clients)
    with ThreadPoolExecutor(num_clients) as pool:
        replies = list(pool.map(lambda b: one_request(endpoint, b, start), bodies))
    answered = [r["total_s"] for r in replies if r["status"] == 200]
    refused = [r for r in replies if r["status"] == 503]
    connects = [r["connect_s"] for r in replies]
    return {"clients": num_clients, "answered": len(answered), "refused_503": len(refused),
            "other_statuses": sorted({r["status"] for r in replies} - {200, 503}),
            "all_refusals_have_retry_after": all(r["retry_after"] for r in refused),
            "connect_p99_ms": round(percentile(connects, 0.99) * 1000, 1),
            "answered_p50_s": round(median(answered), 3) if answered else None,
            "answered_p99_s": round(percentile(answered, 0.99), 3) if answered else None,
            "refusal_p99_ms": round(percentile([r["total_s"] for r in refused], 0.99) * 1000, 1) if refused else None}


def first_chunk_vs_whole(endpoint) -> dict:
    def timed(stream: bool) -> tuple[float, float]:
        conn = http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=300)
        started_s = time.perf_counter()
        conn.request("POST", "/v1/chat/completions",
                     body=request_body(10_000, stream=stream, max_tokens=STREAM_MAX_TOKENS),
                     headers=endpoint.headers())
        response = conn.getresponse()
        first_s = None
        for line in response:
            if first_s is None and b'"content": "' in line and b'"content": ""' not in line:
                first_s = time.perf_counter() - started_s
        conn.close()
        total_s = time.perf_counter() - started_s
        return (first_s if stream else total_s), total_s
    timed(False)                                            # warm up (frame cache is per frame: same for both)
    whole = [timed(False)[1] for _ in range(3)]
    streamed = [timed(True) for _ in range(3)]
    return {"whole_answer_s": round(median(whole), 3),
            "stream_first_chunk_s": round(median([s[0] for s in streamed]), 3),
            "stream_total_s": round(median([s[1] for s in streamed]), 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.backpressure", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json-out", type=Path, default=DEFAULT_JSON_OUT)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="deskeye-backpressure-") as tmp:
        model = args.model or _tiny_model(Path(tmp))
        rows = {}
        for name, max_queue in (("unbounded queue", UNBOUNDED_QUEUE), (f"--max-queue {BOUNDED_QUEUE}", BOUNDED_QUEUE)):
            with deskeye_worker(model, Path(tmp) / f"q{max_queue}", num_threads=args.threads, device="cpu",
                                max_batch_size=8, extra_args=("--max-queue", str(max_queue))) as endpoint:
                rows[name] = burst(endpoint, args.clients)
                if max_queue == BOUNDED_QUEUE:
                    streaming = first_chunk_vs_whole(endpoint)
    print(f"\nburst of {args.clients} clients, one request each ({MAX_TOKENS} tokens, 800x600 frame each)")
    print(table(["worker", "answered", "503", "connect p99 ms", "answered p50 s", "answered p99 s", "503 p99 ms"],
                [[name, r["answered"], r["refused_503"], r["connect_p99_ms"], r["answered_p50_s"],
                  r["answered_p99_s"], r["refusal_p99_ms"]] for name, r in rows.items()]))
    print(f"\nstreaming a {STREAM_MAX_TOKENS}-token answer: first content chunk {streaming['stream_first_chunk_s']} s, whole answer "
          f"{streaming['whole_answer_s']} s (streamed total {streaming['stream_total_s']} s)")
    write_result(args.json_out, {"model": args.model or "tiny random Idefics3", "burst": rows, "streaming": streaming})
    return 0


def table(header: list[str], rows: list[list]) -> str:
    cells = [header] + [[fmt(v, 3) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells)


def _tiny_model(tmp: Path) -> str:
    from tests.fixtures.tiny_models import build_tiny_idefics3
    return str(build_tiny_idefics3(tmp / "tiny_idefics3"))


if __name__ == "__main__":
    raise SystemExit(main())
