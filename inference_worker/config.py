"""The worker's one validated configuration object, built by the CLI and passed to every part.

Each field has a `deskeye-worker` flag of the same name (cli.py); `__post_init__` rejects bad values with a
message that names the option and what it accepts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from inference_worker.errors import ConfigError  # noqa: F401 - re-exported: the CLI imports it from here

ENGINES = ("auto", "ocr", "transformers", "openvino")
DEVICES = ("auto", "cuda", "cpu")
DTYPES = ("auto", "bf16", "fp16", "fp32")

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


@dataclass
class WorkerConfig:
    engine: str = "auto"                 # auto = transformers when --model is given (OCR if it cannot load), else ocr
    model: str = ""                      # local folder or Hugging Face id of a vision-language model
    device: str = "auto"                 # auto | cuda | cpu
    dtype: str = "auto"                  # auto | bf16 | fp16 | fp32
    host: str = "127.0.0.1"              # address to listen on; loopback only unless you mean it
    port: int = 0                        # 0 = a free port chosen by the OS (written to the state file)
    api_key: str | None = None           # None = a new random key per launch, written to the state file
    state_file: Path | None = None       # None = <user runtime dir>/deskeye/worker.json
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_request_pixels: int | None = None   # all images of a request; None = DEFAULT_MAX_REQUEST_PIXELS or, if
                                            # larger, max_image_pixels
    max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT
    max_images: int = DEFAULT_MAX_IMAGES
    max_prompt_tokens: int = 0           # longest prompt accepted, in tokens; 0 = the model's context
    max_retries: int = 2                 # re-generations when JSON output is cut off or invalid
    use_grammar: bool = True             # constrain JSON output to the schema while generating
    num_threads: int = 0                 # CPU threads for torch; 0 = the library's default
    ground_with_ocr: bool = False        # add the OCR text of each image to the model's prompt
    request_timeout_s: float = 300.0     # a request waiting longer than this for the model gets 504
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S   # a request body slower than this gets 408
    max_queue: int = DEFAULT_MAX_QUEUE   # accepted requests waiting for the model; one more gets 503 + Retry-After
    max_connections: int = DEFAULT_MAX_CONNECTIONS   # HTTP requests served at once; one more gets 503
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S   # a request head slower than this: 408, closed
    max_idle_connections: int = DEFAULT_MAX_IDLE_CONNECTIONS   # per client; one more closes the longest waiting
    max_batch_size: int = 8              # most requests decoded together; 1 = one at a time
    batch_window_ms: tuple[float, float, float] = DEFAULT_BATCH_WINDOW_MS
    load_thresholds_pct: tuple[float, float] = DEFAULT_LOAD_THRESHOLDS_PCT
    preprocess_threads: int = 2          # threads decoding images and running the processor
    prepare_processes: int = 0           # child processes running the processor for those threads (0 = none)
    kv_reuse: bool = True                # keep each frame's prefix KV and reuse it (exact level)
    kv_cache_mb: int = DEFAULT_KV_CACHE_MB
    kv_similar: bool = True              # also reuse a near-identical frame's KV (an approximation)
    kv_similar_threshold: float = DEFAULT_KV_SIMILAR_THRESHOLD
    cache_dir: Path | None = None        # OpenVINO compiled-model cache; None = <user cache dir>/deskeye/openvino

    def __post_init__(self):
        _check(self.engine in ENGINES, "--engine", " | ".join(ENGINES), self.engine)
        _check(self.device in DEVICES, "--device", " | ".join(DEVICES), self.device)
        _check(self.dtype in DTYPES, "--dtype", " | ".join(DTYPES), self.dtype)
        _check(self.engine not in ("transformers", "openvino") or bool(self.model), "--model",
               f"a model folder or Hugging Face id (--engine {self.engine} needs one)", self.model)
        if self.cache_dir is not None:
            self.cache_dir = Path(self.cache_dir).expanduser()
        _check(bool(self.host.strip()), "--host", "an address such as 127.0.0.1", self.host)
        _check(0 <= self.port <= 65535, "--port", "a port from 0 to 65535 (0 = any free port)", self.port)
        if self.api_key is not None:
            _check(bool(self.api_key) and not any(c.isspace() for c in self.api_key), "--api-key",
                   "a non-empty key without spaces (leave it out to get a random one)", "<hidden>")
        if self.state_file is not None:
            self.state_file = Path(self.state_file).expanduser()
        _check(self.max_body_bytes >= 1024, "--max-body-bytes", "an integer >= 1024", self.max_body_bytes)
        _check(self.max_image_pixels >= 64 * 64, "--max-image-pixels", "an integer >= 4096", self.max_image_pixels)
        if self.max_request_pixels is None:
            self.max_request_pixels = max(DEFAULT_MAX_REQUEST_PIXELS, self.max_image_pixels)
        _check(self.max_request_pixels >= self.max_image_pixels, "--max-request-pixels",
               f"an integer >= --max-image-pixels ({self.max_image_pixels})", self.max_request_pixels)
        _check(self.max_tokens_limit >= 1, "--max-tokens-limit", "an integer >= 1", self.max_tokens_limit)
        _check(self.max_images >= 0, "--max-images", "an integer >= 0", self.max_images)
        _check(self.max_prompt_tokens == 0 or 16 <= self.max_prompt_tokens <= 10_000_000, "--max-prompt-tokens",
               "0 (the model's context) or an integer from 16 to 10000000", self.max_prompt_tokens)
        _check(0 <= self.max_retries <= 10, "--max-retries", "an integer from 0 to 10", self.max_retries)
        _check(self.num_threads >= 0, "--threads", "an integer >= 0 (0 = default)", self.num_threads)
        _check(self.request_timeout_s > 0, "--request-timeout-s", "a number of seconds > 0", self.request_timeout_s)
        _check(self.body_timeout_s > 0, "--body-timeout-s", "a number of seconds > 0", self.body_timeout_s)
        _check(1 <= self.max_queue <= 100_000, "--max-queue", "an integer from 1 to 100000", self.max_queue)
        _check(1 <= self.max_connections <= 10_000, "--max-connections", "an integer from 1 to 10000",
               self.max_connections)
        _check(0 < self.header_timeout_s <= MAX_HEADER_TIMEOUT_S, "--header-timeout-s",
               f"a number of seconds above 0 and at most {MAX_HEADER_TIMEOUT_S:g}", self.header_timeout_s)
        _check(1 <= self.max_idle_connections <= 10_000, "--max-idle-connections", "an integer from 1 to 10000",
               self.max_idle_connections)
        _check(1 <= self.max_batch_size <= 64, "--max-batch-size", "an integer from 1 to 64", self.max_batch_size)
        self.batch_window_ms = tuple(float(v) for v in self.batch_window_ms)
        _check(len(self.batch_window_ms) == 3 and all(0 <= v <= 5000 for v in self.batch_window_ms),
               "--batch-window-ms", "three millisecond values from 0 to 5000, e.g. 50,150,200", self.batch_window_ms)
        self.load_thresholds_pct = tuple(float(v) for v in self.load_thresholds_pct)
        low_high = self.load_thresholds_pct
        _check(len(low_high) == 2 and 0 <= low_high[0] <= low_high[1] <= 100, "--load-thresholds",
               "two percentages LOW,HIGH with 0 <= LOW <= HIGH <= 100, e.g. 30,70", low_high)
        _check(1 <= self.preprocess_threads <= 32, "--preprocess-threads", "an integer from 1 to 32",
               self.preprocess_threads)
        _check(0 <= self.prepare_processes <= 16, "--prepare-processes", "an integer from 0 to 16 (0 = none)",
               self.prepare_processes)
        _check(self.kv_cache_mb >= 0, "--kv-cache-mb", "an integer >= 0 (0 = no KV reuse)", self.kv_cache_mb)
        _check(0 < self.kv_similar_threshold <= 0.5, "--kv-similar-threshold",
               "a share of changed cells above 0 and at most 0.5", self.kv_similar_threshold)

    @property
    def kv_cache_bytes(self) -> int:
        """The KV cache budget in bytes; 0 when reuse is off."""
        return self.kv_cache_mb * 1024 * 1024 if self.kv_reuse else 0

    @property
    def wants_transformers(self) -> bool:
        return self.engine == "transformers" or (self.engine == "auto" and bool(self.model))


def _check(ok: bool, flag: str, expected: str, got: object) -> None:
    if not ok:
        raise ConfigError(f"{flag} must be {expected}; got {got!r}.")
