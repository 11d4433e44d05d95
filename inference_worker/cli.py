"""`deskeye-worker`: start the inference worker. Parses argv only inside `main`.

Every WorkerConfig field has a flag (its argparse `dest` is the field name). Errors are one line on stderr
and a non-zero exit status, never a traceback: 2 for bad options, 1 when the worker cannot start.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from inference_worker.config import (DEFAULT_BATCH_WINDOW_MS, DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S,
                                     DEFAULT_KV_CACHE_MB, DEFAULT_MAX_IDLE_CONNECTIONS,
                                     DEFAULT_KV_SIMILAR_THRESHOLD, DEFAULT_LOAD_THRESHOLDS_PCT, DEFAULT_MAX_BODY_BYTES,
                                     DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_IMAGES,
                                     DEFAULT_MAX_REQUEST_PIXELS,
                                     DEFAULT_MAX_QUEUE, DEFAULT_MAX_TOKENS_LIMIT, DEVICES, DTYPES, ENGINES, ConfigError, WorkerConfig)

PROG = "deskeye-worker"
API_KEY_ENV = "DESKEYE_WORKER_API_KEY"


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineParser(
        prog=PROG,
        description="DeskEye's inference worker: an OpenAI-compatible HTTP server (POST /v1/chat/completions, "
                    "GET /v1/models, GET /health, GET /metrics) that owns the model. It listens on 127.0.0.1, "
                    "requires 'Authorization: Bearer KEY' (except /health), and writes its URL and key to a "
                    "state file readable only by you.",
    )
    _add_engine_options(p.add_argument_group("engine"))
    _add_server_options(p.add_argument_group("server"))
    _add_batching_options(p.add_argument_group("batching (concurrent requests are decoded together)"))
    _add_kv_reuse_options(p.add_argument_group(
        "frame KV reuse (a new question about a frame already seen skips its prefill)"))
    _add_limits_options(p.add_argument_group("request limits (a request over a limit gets HTTP 400 or 413 naming it)"))
    p.add_argument("--verbose", action="store_true",
                   help="log every request and rejected output, and show tracebacks of engine errors")
    return p


def _add_engine_options(g) -> None:
    g.add_argument("--engine", choices=ENGINES, default="auto",
                   help="auto (default) = transformers when --model is given (OCR, with a warning, if it cannot "
                        "load), else ocr; ocr = RapidOCR on the CPU, no model weights; transformers = the "
                        "--model vision-language model (a load failure is an error); openvino = an OpenVINO IR folder made by "
                        "scripts/export_openvino.sh, on the CPU (auto picks it when --model is such a folder)")
    g.add_argument("--model", metavar="PATH_OR_ID", default="",
                   help="vision-language model: a local folder, or a Hugging Face id (downloaded once when "
                        "online; offline it must be in the local cache)")
    g.add_argument("--device", choices=DEVICES, default="auto",
                   help="where the model runs (default: auto = cuda if present, else cpu)")
    g.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="weight precision (default: auto = bf16 on a GPU that supports it, fp16 on other "
                        "GPUs; on the CPU bf16 where it computes in bf16 natively (AMX or AVX-512 BF16 in "
                        "/proc/cpuinfo) for models of 100M parameters or more, else fp32)")
    g.add_argument("--threads", dest="num_threads", type=int, default=0, metavar="N",
                   help="CPU threads for torch (default: 0 = torch's default, one per physical core; 1 is "
                        "steadiest on a shared machine)")
    g.add_argument("--no-grammar", dest="use_grammar", action="store_false",
                   help="do not constrain JSON output with a grammar while generating (for tests and "
                        "benchmarks; answers are still validated and retried)")
    g.add_argument("--cache-dir", dest="cache_dir", type=Path, default=None, metavar="DIR",
                   help="OpenVINO's compiled-model cache, so restarts skip compiling (default: <user cache "
                        "dir>/deskeye/openvino)")
    g.add_argument("--ground-with-ocr", dest="ground_with_ocr", action="store_true",
                   help="add the OCR text of each image to the model's prompt")
    g.add_argument("--max-retries", type=int, default=2, metavar="N",
                   help="re-generations when JSON output is cut off or does not match the schema: first with "
                        "twice the tokens, then greedy; after that the request gets HTTP 502 "
                        "(default: %(default)s)")


def _add_server_options(g) -> None:
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: %(default)s); keep the loopback address unless other "
                        "machines must reach it")
    g.add_argument("--port", type=int, default=0,
                   help="TCP port (default: 0 = a free port chosen by the OS; the URL is in the state file)")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"bearer key clients must send (default: ${API_KEY_ENV} if set, else a new random key "
                        "per launch); it is written to the state file")
    g.add_argument("--state-file", type=Path, default=None, metavar="PATH",
                   help='where to write {"url", "api_key", "pid", "model", "engine"}, mode 0600, removed on '
                        "exit (default: <user runtime dir>/deskeye/worker.json)")
    g.add_argument("--request-timeout-s", type=float, default=300.0, metavar="SECONDS",
                   help="a request that waits longer than this for the model is answered 504 "
                        "(default: %(default)s)")
    g.add_argument("--body-timeout-s", type=float, default=DEFAULT_BODY_TIMEOUT_S, metavar="SECONDS",
                   help="a request body that has not fully arrived this long after its headers is answered 408 "
                        "(default: %(default)s)")
    g.add_argument("--header-timeout-s", type=float, default=DEFAULT_HEADER_TIMEOUT_S, metavar="SECONDS",
                   help="a request head (request line and headers) must arrive within this many seconds of the "
                        "connection opening (or of its first byte on a kept-alive connection), however slowly it "
                        "trickles; else 408 and the connection is closed (default: %(default)s)")
    g.add_argument("--max-idle-connections", type=int, default=DEFAULT_MAX_IDLE_CONNECTIONS, metavar="N",
                   help="most connections one client address keeps open without a request in progress (idle "
                        "between requests, or still sending a request head); one more closes the one that has "
                        "waited longest, never the new one (default: %(default)s; all addresses together: 4x)")
    g.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE, metavar="N",
                   help="most accepted requests waiting for the model (being prepared or queued); one more is "
                        "answered 503 with Retry-After at once (default: %(default)s)")
    g.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS, metavar="N",
                   help="most HTTP requests served at once, streams included; one more is answered 503 with "
                        "Retry-After (default: %(default)s)")


def _add_batching_options(g) -> None:
    g.add_argument("--max-batch-size", type=int, default=8, metavar="N",
                   help="most requests decoded in one batch; a full batch starts at once; 1 = one request at "
                        "a time (default: %(default)s)")
    g.add_argument("--batch-window-ms", type=_numbers(3), default=DEFAULT_BATCH_WINDOW_MS, metavar="LOW,MID,HIGH",
                   help="how long the first queued request waits for others, by load: under the low threshold, "
                        "between, above the high one (default: 50,150,200)")
    g.add_argument("--load-thresholds", dest="load_thresholds_pct", type=_numbers(2),
                   default=DEFAULT_LOAD_THRESHOLDS_PCT, metavar="LOW,HIGH",
                   help="load percentages where the window steps up; load is GPU utilisation (NVML) where "
                        "available, raised by the worker's own busy share and queue (default: 30,70)")
    g.add_argument("--preprocess-threads", type=int, default=2, metavar="N",
                   help="threads that decode images and run the processor while the model generates "
                        "(default: %(default)s)")
    g.add_argument("--prepare-processes", type=int, default=0, metavar="N",
                   help="child processes that decode images and run the processor for those threads, off the "
                        "model thread's GIL: for a model thread the processor holds up (a GPU model with cores "
                        "to spare); on a 2-core CPU it did not pay (README). Each child costs memory (torch and "
                        "the processor) and a few seconds at start (default: %(default)s: the threads do it)")


def _add_kv_reuse_options(g) -> None:
    g.add_argument("--kv-cache-mb", type=int, default=DEFAULT_KV_CACHE_MB, metavar="MB",
                   help="memory for kept prefix KV, least recently used dropped first (default: %(default)s)")
    g.add_argument("--no-kv-reuse", dest="kv_reuse", action="store_false",
                   help="never reuse a frame's KV (every request is prefilled from scratch)")
    g.add_argument("--no-kv-similar", dest="kv_similar", action="store_false",
                   help="reuse only for exactly the same frame; by default a frame that differs in a few "
                        "pixels reuses the older frame's KV, so the model answers about the older frame")
    g.add_argument("--kv-similar-threshold", type=float, default=DEFAULT_KV_SIMILAR_THRESHOLD, metavar="SHARE",
                   help="largest share of a frame's 64x48 cells that may differ for a similar hit "
                        "(default: %(default)s, about 6 cells: a cursor, a ticking clock, one changed word)")


def _add_limits_options(g) -> None:
    g.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="N",
                   help="largest request body accepted, in bytes (default: %(default)s = 32 MiB)")
    g.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS, metavar="N",
                   help="largest image accepted, in pixels (width x height), checked from the file header "
                        "before decoding (default: %(default)s = 7680x4320)")
    g.add_argument("--max-request-pixels", type=int, default=None, metavar="N",
                   help="most pixels of all the images of one request together, also read from the file headers "
                        f"before decoding; it bounds a request's decoding time and memory (default: "
                        f"{DEFAULT_MAX_REQUEST_PIXELS} = one 7680x4320 or four 3840x2160 frames, or "
                        "--max-image-pixels if that is larger)")
    g.add_argument("--max-tokens-limit", type=int, default=DEFAULT_MAX_TOKENS_LIMIT, metavar="N",
                   help="largest max_tokens a request may ask for; also caps retries (default: %(default)s)")
    g.add_argument("--max-images", type=int, default=DEFAULT_MAX_IMAGES, metavar="N",
                   help="most images in one request (default: %(default)s)")
    g.add_argument("--max-prompt-tokens", type=int, default=0, metavar="N",
                   help="longest prompt accepted, in tokens, images included; a longer one (or one that leaves the "
                        "answer no room in the model's context) gets HTTP 400 saying by how much it is over "
                        "(default: 0 = the model's context)")


def _numbers(count: int):
    """argparse type: COUNT comma-separated numbers, e.g. "50,150,200"."""
    def parse(text: str) -> tuple[float, ...]:
        try:
            values = tuple(float(v) for v in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {count} comma-separated numbers, got {text!r}") from None
        if len(values) != count:
            raise argparse.ArgumentTypeError(f"expected {count} comma-separated numbers, got {text!r}")
        return values
    return parse


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    values = {k: v for k, v in vars(args).items() if k != "verbose"}
    if values["api_key"] is None:
        values["api_key"] = os.environ.get(API_KEY_ENV) or None
    return WorkerConfig(**values)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _configure_logging(args.verbose)
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        return _fail(str(exc), 2)
    return _run(config)


def _run(config: WorkerConfig) -> int:
    from inference_worker.server.auth import StateFileError
    from inference_worker.server.lifetime import WorkerStartError, run_worker

    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    try:
        run_worker(config, stop)
    except (WorkerStartError, StateFileError) as exc:
        return _fail(str(exc), 1)
    return 0


def _fail(message: str, status: int) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return status


def _configure_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr,
                        format=f"{PROG}: %(levelname)s: %(message)s")
    logging.getLogger("deskeye.worker").setLevel(logging.DEBUG if verbose else logging.INFO)


if __name__ == "__main__":
    sys.exit(main())
