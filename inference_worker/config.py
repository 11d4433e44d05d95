"""The worker's one validated configuration object, built by the CLI and passed to every part.

Each field carries its `deskeye-worker` flag in its metadata (`option`: the --help section, the help text, and
where it differs from the field, the flag's name, metavar and parser), so the default, the flag and its help are
written once; cli.py builds the parser from `dataclasses.fields(WorkerConfig)`. `__post_init__` rejects bad values
with a message that names the flag and what it accepts.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from inference_worker.errors import ConfigError  # noqa: F401 - re-exported: the CLI imports it from here

ENGINES = ("auto", "ocr", "transformers", "openvino")
MODEL_ENGINES = ("transformers", "openvino")           # the engines that need --model
DEVICES = ("auto", "cuda", "cpu")
DTYPES = ("auto", "bf16", "fp16", "fp32")
DECODE_WEIGHTS = ("auto", "int8", "model")             # engines/hf/int8_decode.py

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024          # a full-HD PNG is ~2-6 MB, base64 adds a third
DEFAULT_MAX_IMAGE_PIXELS = 7680 * 4320             # an 8K frame; larger is refused before decoding
DEFAULT_MAX_REQUEST_PIXELS = 7680 * 4320           # all of a request's images together: one 8K or four 4K frames
DEFAULT_MAX_TOKENS_LIMIT = 1024
DEFAULT_MAX_IMAGES = 4
DEFAULT_BATCH_WINDOW_MS = (50.0, 150.0, 200.0)     # wait window at low / medium / high load
DEFAULT_LOAD_THRESHOLDS_PCT = (30.0, 70.0)         # load (%) where the window steps up
DEFAULT_KV_CACHE_MB = 512
DEFAULT_MAX_QUEUE = 32                             # accepted requests waiting for the model: 4 batches of 8
DEFAULT_MAX_CONNECTIONS = 64                       # HTTP requests served at once (streams included)
DEFAULT_BODY_TIMEOUT_S = 10.0                      # a body must arrive this fast (loopback: milliseconds)
DEFAULT_HEADER_TIMEOUT_S = 5.0                     # a request head must arrive this fast (loopback: milliseconds)
DEFAULT_MAX_IDLE_CONNECTIONS = 64                  # per client address: open without a request in progress
MAX_HEADER_TIMEOUT_S = 3600.0
LISTEN_BACKLOG = 128                               # connections the kernel queues before accept()
DEFAULT_KV_SIMILAR_THRESHOLD = 0.002               # share of 64x48 cells that may differ for a similar hit
API_KEY_ENV = "DESKEYE_WORKER_API_KEY"             # the key when --api-key is not given

# the --help sections, in the order they are shown (a field names its section)
ENGINE_OPTIONS = "engine"
SERVER_OPTIONS = "server"
BATCHING_OPTIONS = "batching (concurrent requests are decoded together)"
KV_REUSE_OPTIONS = "frame KV reuse (a new question about a frame already seen skips its prefill)"
LIMIT_OPTIONS = "request limits (a request over a limit gets HTTP 400 or 413 naming it)"


@dataclass(frozen=True)
class Flag:
    """How a WorkerConfig field appears on the command line. A bool field is a switch that flips its default
    (`name` is then --no-... for a default of True); any other field takes a value, parsed by `parse` (default:
    the type of the field's default, for int and float; the text itself otherwise)."""
    section: str
    help: str
    name: str = ""                       # "" = --the-field-name
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None


def option(default: Any, section: str, help: str, **flag: Any) -> Any:
    """A WorkerConfig field with its default and its flag (see Flag)."""
    return field(default=default, metadata={"flag": Flag(section, help, **flag)})


def numbers(count: int) -> Callable[[str], tuple[float, ...]]:
    """A flag parser: COUNT comma-separated numbers, e.g. "50,150,200"."""
    def parse(text: str) -> tuple[float, ...]:
        try:
            values = tuple(float(v) for v in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {count} comma-separated numbers, got {text!r}") from None
        if len(values) != count:
            raise argparse.ArgumentTypeError(f"expected {count} comma-separated numbers, got {text!r}")
        return values
    return parse


@dataclass
class WorkerConfig:
    # ------------------------------------------------------------ engine
    engine: str = option(
        "auto", ENGINE_OPTIONS, choices=ENGINES,
        help="auto (default) = transformers when --model is given (OCR, with a warning, if it cannot load), else "
             "ocr; ocr = RapidOCR on the CPU, no model weights; transformers = the --model vision-language model (a "
             "load failure is an error); openvino = an OpenVINO IR folder made by scripts/export_openvino.sh, on the "
             "CPU (auto picks it when --model is such a folder)")
    model: str = option(
        "", ENGINE_OPTIONS, metavar="PATH_OR_ID",
        help="vision-language model: a local folder, or a Hugging Face id (downloaded once when online; offline it "
             "must be in the local cache)")
    device: str = option("auto", ENGINE_OPTIONS, choices=DEVICES,
                         help="where the model runs (default: auto = cuda if present, else cpu)")
    dtype: str = option(
        "auto", ENGINE_OPTIONS, choices=DTYPES,
        help="weight precision (default: auto = bf16 on a GPU that supports it, fp16 on other GPUs; on the CPU bf16 "
             "where it computes in bf16 natively (AMX or AVX-512 BF16 in /proc/cpuinfo) for models of 100M "
             "parameters or more, else fp32)")
    decode_weights: str = option(
        "auto", ENGINE_OPTIONS, choices=DECODE_WEIGHTS,
        help="what a decode step multiplies by on the CPU: int8 = an int8 copy of each text-model weight (one scale "
             "per row; bf16 MiniCPM-V 4.6 wrote ~1.5x faster, one byte more memory per text parameter); model = "
             "the model's own weights only, its exact arithmetic; default: auto = int8 on the CPU for bf16 text "
             "models of 100M parameters or more when twice the copies fit in the memory available, else model "
             "(in fp32 the int8 kernel was slower). Prefill and the vision tower always use the model's weights")
    num_threads: int = option(
        0, ENGINE_OPTIONS, name="--threads", metavar="N",
        help="CPU threads for torch (default: 0 = torch's default, one per physical core; 1 is steadiest on a "
             "shared machine)")
    use_grammar: bool = option(
        True, ENGINE_OPTIONS, name="--no-grammar",
        help="do not constrain JSON output with a grammar while generating (for tests and benchmarks; answers are "
             "still validated and retried)")
    cache_dir: Path | None = option(
        None, ENGINE_OPTIONS, metavar="DIR", parse=Path,
        help="OpenVINO's compiled-model cache, so restarts skip compiling (default: <user cache dir>/deskeye/openvino)")
    ground_with_ocr: bool = option(False, ENGINE_OPTIONS,
                                   help="add the OCR text of each image to the model's prompt")
    max_retries: int = option(
        2, ENGINE_OPTIONS, metavar="N",
        help="re-generations when JSON output is cut off or does not match the schema: first with twice the tokens, "
             "then greedy; after that the request gets HTTP 502 (default: %(default)s)")
    # ------------------------------------------------------------ server
    host: str = option(
        "127.0.0.1", SERVER_OPTIONS,
        help="address to listen on (default: %(default)s); keep the loopback address unless other machines must "
             "reach it")
    port: int = option(0, SERVER_OPTIONS,
                       help="TCP port (default: 0 = a free port chosen by the OS; the URL is in the state file)")
    api_key: str | None = option(
        None, SERVER_OPTIONS, metavar="KEY",
        help=f"bearer key clients must send (default: ${API_KEY_ENV} if set, else a new random key per launch); it "
             "is written to the state file")
    state_file: Path | None = option(
        None, SERVER_OPTIONS, metavar="PATH", parse=Path,
        help='where to write {"url", "api_key", "pid", "model", "engine", "limits"}, mode 0600, removed on exit '
             "(default: <user runtime dir>/deskeye/worker.json)")
    request_timeout_s: float = option(
        300.0, SERVER_OPTIONS, metavar="SECONDS",
        help="a request that waits longer than this for the model is answered 504 (default: %(default)s)")
    body_timeout_s: float = option(
        DEFAULT_BODY_TIMEOUT_S, SERVER_OPTIONS, metavar="SECONDS",
        help="a request body that has not fully arrived this long after its headers is answered 408 "
             "(default: %(default)s)")
    header_timeout_s: float = option(
        DEFAULT_HEADER_TIMEOUT_S, SERVER_OPTIONS, metavar="SECONDS",
        help="a request head (request line and headers) must arrive within this many seconds of the connection "
             "opening (or of its first byte on a kept-alive connection), however slowly it trickles; else 408 and "
             "the connection is closed (default: %(default)s)")
    max_idle_connections: int = option(
        DEFAULT_MAX_IDLE_CONNECTIONS, SERVER_OPTIONS, metavar="N",
        help="most connections one client address keeps open without a request in progress (idle between "
             "requests, or still sending a request head); one more closes the one that has waited longest, never "
             "the new one (default: %(default)s; all addresses together: 4x)")
    max_queue: int = option(
        DEFAULT_MAX_QUEUE, SERVER_OPTIONS, metavar="N",
        help="most accepted requests waiting for the model (being prepared or queued); one more is answered 503 "
             "with Retry-After at once (default: %(default)s)")
    max_connections: int = option(
        DEFAULT_MAX_CONNECTIONS, SERVER_OPTIONS, metavar="N",
        help="most HTTP requests served at once, streams included; one more is answered 503 with Retry-After "
             "(default: %(default)s)")
    # ------------------------------------------------------------ batching
    max_batch_size: int = option(
        8, BATCHING_OPTIONS, metavar="N",
        help="most requests decoded in one batch; a full batch starts at once; 1 = one request at a time "
             "(default: %(default)s)")
    batch_window_ms: tuple[float, float, float] = option(
        DEFAULT_BATCH_WINDOW_MS, BATCHING_OPTIONS, metavar="LOW,MID,HIGH", parse=numbers(3),
        help="how long the first queued request waits for others, by load: under the low threshold, between, above "
             "the high one (default: 50,150,200)")
    load_thresholds_pct: tuple[float, float] = option(
        DEFAULT_LOAD_THRESHOLDS_PCT, BATCHING_OPTIONS, name="--load-thresholds", metavar="LOW,HIGH",
        parse=numbers(2),
        help="load percentages where the window steps up; load is GPU utilisation (NVML) where available, raised "
             "by the worker's own busy share and queue (default: 30,70)")
    preprocess_threads: int = option(
        2, BATCHING_OPTIONS, metavar="N",
        help="threads that decode images and run the processor while the model generates (default: %(default)s)")
    prepare_processes: int = option(
        0, BATCHING_OPTIONS, metavar="N",
        help="child processes that decode images and run the processor for those threads, off the model thread's "
             "GIL: for a model thread the processor holds up (a GPU model with cores to spare); on a 2-core CPU it "
             "did not pay (README). Each child costs memory (torch and the processor) and a few seconds at start "
             "(default: %(default)s: the threads do it)")
    # ------------------------------------------------------------ frame KV reuse
    kv_cache_mb: int = option(
        DEFAULT_KV_CACHE_MB, KV_REUSE_OPTIONS, metavar="MB",
        help="memory for kept prefix KV, least recently used dropped first (default: %(default)s)")
    kv_reuse: bool = option(True, KV_REUSE_OPTIONS, name="--no-kv-reuse",
                            help="never reuse a frame's KV (every request is prefilled from scratch)")
    kv_similar: bool = option(
        True, KV_REUSE_OPTIONS, name="--no-kv-similar",
        help="reuse only for exactly the same frame; by default a frame that differs in a few pixels reuses the "
             "older frame's KV, so the model answers about the older frame")
    kv_similar_threshold: float = option(
        DEFAULT_KV_SIMILAR_THRESHOLD, KV_REUSE_OPTIONS, metavar="SHARE",
        help="largest share of a frame's 64x48 cells that may differ for a similar hit (default: %(default)s, about "
             "6 cells: a cursor, a ticking clock, one changed word)")
    # ------------------------------------------------------------ request limits
    max_body_bytes: int = option(
        DEFAULT_MAX_BODY_BYTES, LIMIT_OPTIONS, metavar="N",
        help="largest request body accepted, in bytes (default: %(default)s = 32 MiB)")
    max_image_pixels: int = option(
        DEFAULT_MAX_IMAGE_PIXELS, LIMIT_OPTIONS, metavar="N",
        help="largest image accepted, in pixels (width x height), checked from the file header before decoding "
             "(default: %(default)s = 7680x4320)")
    max_request_pixels: int | None = option(
        None, LIMIT_OPTIONS, metavar="N", parse=int,
        help="most pixels of all the images of one request together, also read from the file headers before "
             f"decoding; it bounds a request's decoding time and memory (default: {DEFAULT_MAX_REQUEST_PIXELS} = "
             "one 7680x4320 or four 3840x2160 frames, or --max-image-pixels if that is larger)")
    max_tokens_limit: int = option(
        DEFAULT_MAX_TOKENS_LIMIT, LIMIT_OPTIONS, metavar="N",
        help="largest max_tokens a request may ask for; also caps retries (default: %(default)s)")
    max_images: int = option(DEFAULT_MAX_IMAGES, LIMIT_OPTIONS, metavar="N",
                             help="most images in one request (default: %(default)s)")
    max_prompt_tokens: int = option(
        0, LIMIT_OPTIONS, metavar="N",
        help="longest prompt accepted, in tokens, images included; a longer one (or one that leaves the answer no "
             "room in the model's context) gets HTTP 400 saying by how much it is over (default: 0 = the model's "
             "context)")

    def __post_init__(self):
        check = self._check
        check("engine", self.engine in ENGINES, " | ".join(ENGINES))
        check("device", self.device in DEVICES, " | ".join(DEVICES))
        check("dtype", self.dtype in DTYPES, " | ".join(DTYPES))
        check("decode_weights", self.decode_weights in DECODE_WEIGHTS, " | ".join(DECODE_WEIGHTS))
        check("model", self.engine not in MODEL_ENGINES or bool(self.model),
              f"a model folder or Hugging Face id (--engine {self.engine} needs one)")
        if self.cache_dir is not None:
            self.cache_dir = Path(self.cache_dir).expanduser()
        check("host", bool(self.host.strip()), "an address such as 127.0.0.1")
        check("port", 0 <= self.port <= 65535, "a port from 0 to 65535 (0 = any free port)")
        if self.api_key is not None:
            check("api_key", bool(self.api_key) and not any(c.isspace() for c in self.api_key),
                  "a non-empty key without spaces (leave it out to get a random one)", shown="<hidden>")
        if self.state_file is not None:
            self.state_file = Path(self.state_file).expanduser()
        check("max_body_bytes", self.max_body_bytes >= 1024, "an integer >= 1024")
        check("max_image_pixels", self.max_image_pixels >= 64 * 64, "an integer >= 4096")
        if self.max_request_pixels is None:
            self.max_request_pixels = max(DEFAULT_MAX_REQUEST_PIXELS, self.max_image_pixels)
        check("max_request_pixels", self.max_request_pixels >= self.max_image_pixels,
              f"an integer >= --max-image-pixels ({self.max_image_pixels})")
        check("max_tokens_limit", self.max_tokens_limit >= 1, "an integer >= 1")
        check("max_images", self.max_images >= 0, "an integer >= 0")
        check("max_prompt_tokens", self.max_prompt_tokens == 0 or 16 <= self.max_prompt_tokens <= 10_000_000,
              "0 (the model's context) or an integer from 16 to 10000000")
        check("max_retries", 0 <= self.max_retries <= 10, "an integer from 0 to 10")
        check("num_threads", self.num_threads >= 0, "an integer >= 0 (0 = default)")
        check("request_timeout_s", self.request_timeout_s > 0, "a number of seconds > 0")
        check("body_timeout_s", self.body_timeout_s > 0, "a number of seconds > 0")
        check("max_queue", 1 <= self.max_queue <= 100_000, "an integer from 1 to 100000")
        check("max_connections", 1 <= self.max_connections <= 10_000, "an integer from 1 to 10000")
        check("header_timeout_s", 0 < self.header_timeout_s <= MAX_HEADER_TIMEOUT_S,
              f"a number of seconds above 0 and at most {MAX_HEADER_TIMEOUT_S:g}")
        check("max_idle_connections", 1 <= self.max_idle_connections <= 10_000, "an integer from 1 to 10000")
        check("max_batch_size", 1 <= self.max_batch_size <= 64, "an integer from 1 to 64")
        self.batch_window_ms = tuple(float(v) for v in self.batch_window_ms)
        check("batch_window_ms", len(self.batch_window_ms) == 3 and all(0 <= v <= 5000 for v in self.batch_window_ms),
              "three millisecond values from 0 to 5000, e.g. 50,150,200")
        self.load_thresholds_pct = low_high = tuple(float(v) for v in self.load_thresholds_pct)
        check("load_thresholds_pct", len(low_high) == 2 and 0 <= low_high[0] <= low_high[1] <= 100,
              "two percentages LOW,HIGH with 0 <= LOW <= HIGH <= 100, e.g. 30,70")
        check("preprocess_threads", 1 <= self.preprocess_threads <= 32, "an integer from 1 to 32")
        check("prepare_processes", 0 <= self.prepare_processes <= 16, "an integer from 0 to 16 (0 = none)")
        check("kv_cache_mb", self.kv_cache_mb >= 0, "an integer >= 0 (0 = no KV reuse)")
        check("kv_similar_threshold", 0 < self.kv_similar_threshold <= 0.5,
              "a share of changed cells above 0 and at most 0.5")

    def _check(self, name: str, ok: bool, expected: str, *, shown: object = None) -> None:
        if not ok:
            got = getattr(self, name) if shown is None else shown
            raise ConfigError(f"{flag_name(name)} must be {expected}; got {got!r}.")

    @property
    def kv_cache_bytes(self) -> int:
        """The KV cache budget in bytes; 0 when reuse is off."""
        return self.kv_cache_mb * 1024 * 1024 if self.kv_reuse else 0

    @property
    def wants_transformers(self) -> bool:
        return self.engine == "transformers" or (self.engine == "auto" and bool(self.model))


def flag_of(name: str) -> Flag:
    """The flag of WorkerConfig's field `name`."""
    return WorkerConfig.__dataclass_fields__[name].metadata["flag"]


def flag_name(name: str) -> str:
    """The `deskeye-worker` option that sets WorkerConfig's field `name`, e.g. num_threads -> --threads."""
    return flag_of(name).name or "--" + name.replace("_", "-")
