"""GPU check for a lent CUDA machine (about 4 minutes, no internet): DeskEye's worker serving the real models' sizes.

    python -m benchmarks.gpu_check [--dry] [--only minicpmv46|minicpmo45] [--max-tokens N] [--json-out PATH]

Setup on the GPU machine, once, from the repository root (the venv keeps the machine's own CUDA build of torch;
`dev` brings what the test fixtures the check builds on need, pytest among them):

    python3 -m venv --system-site-packages .venv && .venv/bin/pip install -e '.[worker,dev]'

then `.venv/bin/python -m benchmarks.gpu_check`. Nothing is downloaded: both models are built here with random
weights (their cost per token is the real one; only their words are meaningless).

Parts, each model built in bf16 straight on the GPU (`torch.device("cuda")` as the default device: no slow CPU
init), saved to a folder (on /dev/shm when it has room) and served by a real `deskeye-worker` subprocess:
 1. MiniCPM-V 4.6 at its published size (1,300,428,016 parameters: its model card, config.json and checkpoint
    header): a Qwen3.5-0.8B-class text model (3 linear-attention layers to 1 full), 248,094-row tied head,
    SigLIP2-class vision tower, 448-px slices, up to 9 per frame. The tokenizer, chat template and processor files
    come from the test fixture (tests/fixtures/tiny_models.py): the check uses the vocabulary the fixture carries.
 2. MiniCPM-o 4.5's language model at real size (Qwen3-8B: hidden 4096, 36 layers, 32 heads / 8 KV heads,
    head_dim 128, MLP 12288, 151,936-row untied head, rope theta 1e6) fed by the worker's MiniCPM-o adapter
    (engines/hf/minicpmo.py). The folder is the test stand-in's (tests/fixtures/minicpmo_standin: its own remote
    code, not the official one), grown to real size; its NaViT SigLIP vision tower is built at the real width
    and depth too (1152 wide, 27 layers), or tiny with --small-vision.
Both real sizes are also built on the meta device in every run (--dry too) and their parameters counted: the check
fails when the configs it writes drift from the published counts.
For each model: the engine alone in this process on a batch of 8 (torch.cuda.max_memory_allocated), then the
worker over HTTP: one request at a time vs 8 concurrent clients (throughput ratio), time to first token, decode
tokens/s, the GPU memory NVML saw while the worker ran, and its torch.cuda.empty_cache counter
(deskeye_worker_cuda_empty_cache_total on /metrics), which must rise by at least its model calls
(deskeye_worker_batches_total). On MiniCPM-V 4.6 also the load-adaptive batch window: the worker reads GPU load
through NVML (serving/scheduler.py GpuUtilization) and exports the window it chose
(deskeye_worker_batch_window_seconds, deskeye_worker_load_percent): a lone request with the GPU idle, then a lone
request while this process keeps the GPU busy with matrix products (the in-process load is the same, so only NVML
can move the window), then the 8 concurrent clients. Every request carries its own 800x600 screenshot (no KV reuse
between them) and asks for free text at temperature 0 with a fixed max_tokens.

Prints one table and the checks, and writes JSON (default benchmarks/results/gpu_check.json). Exit status 0 when
every check passed, 1 when one failed, 2 when there is no CUDA GPU (without --dry).

`--dry` runs the same code at tiny sizes on the CPU (what CI runs, tests/test_gpu_check_dry.py): the worker on the
CPU never reads NVML, so the load window is reported as not measured, and VRAM as not applicable.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from benchmarks._harness import Endpoint, fmt, median, render_screen, to_png
from benchmarks._load import Reply, fetch_metrics, post_one, run_closed_loop
from benchmarks._results import write_result

RESULTS_DIR = Path("benchmarks/results")
SEED = 1234
MIB = 1024 * 1024
GPU_BUDGET_S = 300.0
NUM_CONCURRENT = 8
QUESTIONS = ("What is on this screen?", "Which window has focus, and what does it show?",
             "List the buttons you can see.", "Is there an error message on the screen?")

# The worker's /metrics series this check reads (inference_worker/metrics.py).
EMPTY_CACHE_TOTAL = "deskeye_worker_cuda_empty_cache_total"
MODEL_CALLS_TOTAL = "deskeye_worker_batches_total"
BATCH_WINDOW_S = "deskeye_worker_batch_window_seconds"
LOAD_PERCENT = "deskeye_worker_load_percent"
#: how far back the worker's in-process load looks (scheduler.WindowConfig.horizon_s): wait this long to be idle
LOAD_HORIZON_S = 2.0

# ---------------------------------------------------------------- sizes

#: MiniCPM-V 4.6 as published (its model card, public copies of its config.json, its checkpoint's tensor header);
#: written over the tiny fixture's config, whose token ids stay
MINICPMV46_REAL = {
    "top": {"insert_layer_id": 6, "image_size": 448, "downsample_mode": "16x", "tie_word_embeddings": True,
            "drop_vision_last_layer": False},
    "text_config": {"hidden_size": 1024, "num_hidden_layers": 24, "intermediate_size": 3584,
                    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
                    "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
                    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "tie_word_embeddings": True,
                    "max_position_embeddings": 32768, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
                    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}},
    "vision_config": {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
                      "num_attention_heads": 16, "image_size": 980, "patch_size": 14, "insert_layer_id": 6},
    "image_processor": {"scale_resolution": 448, "patch_size": 14, "max_slice_nums": 9, "slice_mode": True,
                        "downsample_mode": "16x"},
    "vocab_rows": 248_094,
}
MINICPMV46_PARAMS = 1_300_428_016         # the published checkpoint's 779 bf16 tensors, which these sizes match
#: --dry: the least output rows a tiny model gets; more when its fixture's tokenizer has more tokens (the fixtures
#: carry their family's real vocabulary). Rows past a tokenizer's end are ids that decode to nothing.
DRY_VOCAB_ROWS = 4096
#: --dry: the fixture's tiny model with the real layer pattern (3 linear : 1 full) and slicing on
MINICPMV46_DRY = {
    "top": {}, "vision_config": {},
    "text_config": {"num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"]},
    "image_processor": {"scale_resolution": 112, "max_slice_nums": 4, "slice_mode": True},
    "vocab_rows": DRY_VOCAB_ROWS,
}
#: MiniCPM-o 4.5's language model is Qwen3-8B (public config.json of Qwen/Qwen3-8B; MiniCPM-o's own config may
#: cut the head to its 151,748 tokens, 0.1 % fewer rows); the stand-in's config is flat, as the real one
QWEN3_8B = {"hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "intermediate_size": 12288, "max_position_embeddings": 40960, "rope_theta": 1e6,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
MINICPMO45_REAL = {"llm": QWEN3_8B, "vocab_rows": 151_936}
QWEN3_8B_PARAMS = 8_190_735_360           # Qwen3-8B's model card: 8.2B, 6.95B without the embedding and head
MINICPMO45_DRY = {"llm": {}, "vocab_rows": DRY_VOCAB_ROWS}
#: MiniCPM-o 4.5's vision tower (SigLIP-400M class; the stand-in config's own default_vision_config)
MINICPMO45_VISION_REAL = {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
                          "num_attention_heads": 16, "image_size": 980, "patch_size": 14}


@dataclass(frozen=True)
class Plan:
    """How one run measures: the real sizes on CUDA, or the tiny dry run on the CPU."""
    is_dry: bool
    device: str                      # "cuda" | "cpu"
    max_tokens: int                  # per request, fixed (random models rarely stop early)
    num_one_at_a_time: int           # requests sent one after another
    num_concurrent: int              # requests sent at once, by as many clients
    worker_threads: int              # the worker's --threads (0 = torch's default)
    worker_start_timeout_s: float
    small_vision: bool               # MiniCPM-o stand-in with a tiny vision tower

    def __post_init__(self):
        if min(self.max_tokens, self.num_one_at_a_time, self.num_concurrent) < 1:
            raise ValueError("max_tokens, num_one_at_a_time and num_concurrent must be at least 1")


def plan_for(args: argparse.Namespace) -> Plan:
    if args.dry:       # one torch thread: the shared CI cores (torch's default threading is erratic there)
        return Plan(is_dry=True, device="cpu", max_tokens=args.max_tokens or 8, num_one_at_a_time=4,
                    num_concurrent=NUM_CONCURRENT, worker_threads=1, worker_start_timeout_s=120.0, small_vision=True)
    return Plan(is_dry=False, device="cuda", max_tokens=args.max_tokens or 64, num_one_at_a_time=4,
                num_concurrent=NUM_CONCURRENT, worker_threads=0, worker_start_timeout_s=240.0,
                small_vision=args.small_vision)


# ---------------------------------------------------------------- NVML

class Nvml:
    """GPU 0 as NVML (nvidia-ml-py, import name pynvml) sees it: utilisation and memory in use, or why not."""

    def __init__(self, device_index: int = 0):
        self.reason = ""
        self._nvml = self._handle = None
        try:
            import pynvml
        except ImportError as exc:
            self.reason = f"the nvidia-ml-py package is not installed ({exc})"
            return
        try:
            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
            self._nvml = pynvml
        except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound where there is no driver
            self.reason = f"{type(exc).__name__}: {exc}"

    @property
    def is_available(self) -> bool:
        return self._nvml is not None

    def utilisation_percent(self) -> float | None:
        return self._read(lambda: float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu))

    def used_bytes(self) -> int | None:
        return self._read(lambda: int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used))

    def _read(self, read: Callable[[], Any]) -> Any:
        if self._nvml is None:
            return None
        try:
            return read()
        except Exception as exc:  # noqa: BLE001 - NVMLError_NotSupported and friends: say so, go on
            self.reason = f"{type(exc).__name__}: {exc}"
            return None

    def close(self) -> None:
        if self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
            self._nvml = None


class NvmlSampler:
    """Samples NVML every `interval_s` in a thread while open: the peaks of memory used and of utilisation."""

    def __init__(self, nvml: Nvml, interval_s: float = 0.05):
        self.nvml, self.interval_s = nvml, interval_s
        self.peak_used_bytes: int | None = None
        self.peak_utilisation: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-check-nvml", daemon=True)

    def __enter__(self) -> "NvmlSampler":
        if self.nvml.is_available:
            self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def reset_utilisation(self) -> None:
        self.peak_utilisation = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            used, busy = self.nvml.used_bytes(), self.nvml.utilisation_percent()
            if used is not None:
                self.peak_used_bytes = max(used, self.peak_used_bytes or 0)
            if busy is not None:
                self.peak_utilisation = max(busy, self.peak_utilisation or 0.0)


@contextlib.contextmanager
def gpu_kept_busy(device: str) -> Iterator[None]:
    """Another GPU user: a thread of this process runs bf16 matrix products back to back until the block ends."""
    import torch

    stop = threading.Event()
    matrix = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)

    def burn() -> None:
        while not stop.is_set():
            for _ in range(4):
                matrix @ matrix
            torch.cuda.synchronize(device)
    thread = threading.Thread(target=burn, name="gpu-check-load", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


# ---------------------------------------------------------------- model folders

@dataclass
class BuiltModel:
    """A model folder the worker can load, and what went into it."""
    key: str
    title: str
    folder: Path
    num_params: int
    vocab_rows: int
    tokenizer_size: int
    dtype: str
    sizes: str                       # what was built, in words (said in the output)
    real_params: int                 # the real size's parameters (built on the meta device, in every mode)
    expected_real_params: int
    real_params_of: str
    build_s: float = 0.0
    save_s: float = 0.0


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")


def _drop_weights(folder: Path) -> None:
    """The fixture's tiny weights go: the real-size ones are saved in their place (maybe sharded)."""
    for path in [*folder.glob("*.safetensors"), *folder.glob("*.safetensors.index.json")]:
        path.unlink()


def minicpmv46_config(fixture: dict, *, is_real: bool) -> dict:
    """The fixture's config.json with the real (or --dry) sizes written over it; the token ids stay the fixture's."""
    sizes = MINICPMV46_REAL if is_real else MINICPMV46_DRY
    config = json.loads(json.dumps(fixture))
    config.update(sizes["top"])
    config["vision_config"].update(sizes["vision_config"])
    text = config["text_config"]
    layer_pattern = sizes["text_config"]["layer_types"]
    text.update(sizes["text_config"])
    text["layer_types"] = layer_pattern * (text["num_hidden_layers"] // len(layer_pattern))
    text["vocab_size"] = max(text["vocab_size"], sizes["vocab_rows"])      # the fixture's tokenizer may be larger
    return config


def minicpmo45_config(fixture: dict, *, is_real: bool, small_vision: bool = False) -> dict:
    """The stand-in's config.json (flat: the language model's keys at the top) at Qwen3-8B's size (--dry: the
    stand-in's own), its vision tower at the real size unless `small_vision`; audio and TTS not built."""
    sizes = MINICPMO45_REAL if is_real else MINICPMO45_DRY
    config = json.loads(json.dumps(fixture))
    config.update(sizes["llm"], vocab_size=max(config["vocab_size"], sizes["vocab_rows"]))
    if sizes["llm"]:                 # the stand-in's saved per-layer list is for its own depth: Qwen3Config derives it
        config.pop("layer_types", None)
        config["max_window_layers"] = config["num_hidden_layers"]
    if not small_vision:
        config["vision_config"].update(MINICPMO45_VISION_REAL)
    config.update(init_audio=False, init_tts=False, torch_dtype="bfloat16")
    return config


def write_minicpmv46_folder(folder: Path, plan: Plan) -> dict:
    """The fixture's folder (tokenizer, chat template, processor files named as the real checkpoint's) with the
    plan's sizes in config.json and the image processor's settings. Returns the fixture's own config.json."""
    from tests.fixtures.tiny_models import build_tiny_minicpmv46

    build_tiny_minicpmv46(folder)
    fixture = _read_json(folder / "config.json")
    _write_json(folder / "config.json", minicpmv46_config(fixture, is_real=not plan.is_dry))
    processor_config = _read_json(folder / "processor_config.json")
    sizes = MINICPMV46_DRY if plan.is_dry else MINICPMV46_REAL
    processor_config["image_processor"].update(sizes["image_processor"])
    _write_json(folder / "processor_config.json", processor_config)
    _drop_weights(folder)
    return fixture


def write_minicpmo45_folder(folder: Path, plan: Plan) -> dict:
    """The MiniCPM-o stand-in's folder (its remote code, tokenizer, processor) with the plan's sizes in config.json.
    Returns the stand-in's own config.json."""
    from tests.fixtures.minicpmo_standin import build_minicpmo_standin

    build_minicpmo_standin(folder, vision_only=True)
    fixture = _read_json(folder / "config.json")
    _write_json(folder / "config.json", minicpmo45_config(fixture, is_real=not plan.is_dry,
                                                          small_vision=plan.small_vision))
    _drop_weights(folder)
    return fixture


def build_minicpmv46(folder: Path, device, dtype, attn: str):
    """Random weights from the folder's config, made on `device` in `dtype`; and the worker's processor."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText, GenerationConfig

    from inference_worker.engines.hf.minicpmv import MiniCPMVImageProcessor

    config = AutoConfig.from_pretrained(folder)
    torch.manual_seed(SEED)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype, attn_implementation=attn)
    model.generation_config = GenerationConfig.from_pretrained(folder)      # the fixture's EOS / pad ids
    return model.eval(), MiniCPMVImageProcessor.from_pretrained(folder)


def build_minicpmo45(folder: Path, device, dtype, attn: str):
    """Random weights made by the folder's own code (through the adapter's compatibility layer, as the worker
    loads it), on `device` in `dtype`; and its processor."""
    import torch
    from transformers import AutoConfig, AutoModel, AutoProcessor

    from inference_worker.engines.hf.minicpmo_loading import remote_code_compat

    with remote_code_compat():
        config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
        torch.manual_seed(SEED)
        with torch.device(device):
            model = AutoModel.from_config(config, trust_remote_code=True, dtype=dtype, attn_implementation=attn)
        processor = AutoProcessor.from_pretrained(folder, trust_remote_code=True)
    model = model.to(device).eval()          # the resampler makes its position table on the CPU
    model.processor = processor
    return model, processor


def minicpmv46_real_params(folder: Path, fixture: dict) -> int:
    """Parameters of the whole model at the real size, built on the meta device (no memory, under a second)."""
    import torch
    from transformers import AutoModelForImageTextToText, MiniCPMV4_6Config

    config = MiniCPMV4_6Config.from_dict(minicpmv46_config(fixture, is_real=True))
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    return sum(p.numel() for p in model.parameters())


def minicpmo45_real_params(folder: Path, fixture: dict) -> int:
    """Parameters of the language model at the real size, built by the folder's own code on the meta device."""
    import torch
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    from inference_worker.engines.hf.minicpmo_loading import remote_code_compat

    with remote_code_compat():
        config_class = get_class_from_dynamic_module(fixture["auto_map"]["AutoConfig"], folder)
        model_class = get_class_from_dynamic_module(fixture["auto_map"]["AutoModel"], folder)
        config = config_class(**minicpmo45_config(fixture, is_real=True, small_vision=True))
        with torch.device("meta"):
            model = model_class(config)
    return sum(p.numel() for p in model.llm.parameters())


@dataclass(frozen=True)
class Family:
    key: str
    title: str
    write_folder: Callable[[Path, Plan], dict]   # -> the fixture's own config.json
    build: Callable                  # (folder, device, dtype, attn) -> (model, processor)
    loaded_family: str               # LoadedModel.family: which FAMILIES entry the worker picks for it
    make_engine: str                 # "module:function" of that entry's engine factory
    real_params: Callable[[Path, dict], int]     # (folder, fixture config) -> parameters at the real size
    expected_real_params: int        # what they must be
    real_params_of: str              # what that counts, in words
    measures_window: bool = False


FAMILIES = (
    Family("minicpmv46", "MiniCPM-V 4.6", write_minicpmv46_folder, build_minicpmv46, "minicpmv4_6",
           "inference_worker.engines.hf.engine:make_engine", minicpmv46_real_params, MINICPMV46_PARAMS,
           "the whole model, as published", measures_window=True),
    Family("minicpmo45", "MiniCPM-o 4.5 LM", write_minicpmo45_folder, build_minicpmo45, "minicpmo",
           "inference_worker.engines.hf.minicpmo:make_engine", minicpmo45_real_params, QWEN3_8B_PARAMS,
           "the language model, Qwen3-8B's count"),
)


def sizes_in_words(family: Family, plan: Plan) -> str:
    if plan.is_dry:
        return "tiny (--dry)" + (", the real layer pattern (3 linear-attention : 1 full)"
                                 if family.key == "minicpmv46" else "")
    if family.key == "minicpmv46":
        return "real: MiniCPM-V 4.6 as published"
    vision = "tiny stand-in vision tower (--small-vision)" if plan.small_vision else \
        "stand-in NaViT SigLIP vision tower at real size (1152 wide, 26 of 27 layers kept, as the real code)"
    return f"real Qwen3-8B language model; {vision}; the stand-in's own code, not the official remote code"


# ---------------------------------------------------------------- requests

def request_bodies(model: str, prefix: str, count: int, max_tokens: int) -> list[bytes]:
    """`count` free-text requests, each about its own 800x600 screenshot (the app's default region)."""
    from benchmarks.throughput import chat_body

    return [json.dumps(chat_body(model, QUESTIONS[i % len(QUESTIONS)], to_png(render_screen(f"{prefix}-{i}")),
                                 max_tokens=max_tokens, is_json=False)).encode() for i in range(count)]


@dataclass
class Answer:
    """One answer's numbers, from the worker's reply or from the engine in this process."""
    is_ok: bool
    completion_tokens: int = 0
    model_ttft_ms: float | None = None       # the engine: joining the decode -> first token (vision + prefill)
    ttft_ms: float | None = None             # the worker: request arrival -> first token (queue, prepare, prefill)
    decode_ms: float | None = None
    batch_size: int | None = None
    vision_ms: float | None = None           # the image encoding's part of model_ttft_ms, where the engine says
    prompt_tokens: int = 0
    error: str = ""

    @classmethod
    def of_reply(cls, reply: Reply) -> "Answer":
        if not reply.is_ok:
            return cls(False, error=f"HTTP {reply.status}: {reply.error[:300]}")
        timing = reply.deskeye.get("timing", {})
        total, decode = timing.get("total_ms"), timing.get("decode_ms")
        return cls(True, reply.completion_tokens, timing.get("ttft_ms"),
                   None if total is None or decode is None else total - decode, decode,
                   reply.deskeye.get("batch_size"), timing.get("vision_ms"),
                   int(reply.body.get("usage", {}).get("prompt_tokens", 0)))

    @classmethod
    def of_completion(cls, completion) -> "Answer":
        facts = completion.facts
        return cls(True, completion.completion_tokens, facts.timing.ttft_ms, None, facts.timing.decode_ms,
                   facts.batch_size, facts.timing.vision_ms, completion.prompt_tokens)

    @property
    def decode_tokens_per_s(self) -> float | None:
        if not self.decode_ms or self.completion_tokens < 2:
            return None
        return (self.completion_tokens - 1) / (self.decode_ms / 1000)


@dataclass
class Row:
    """One line of the table."""
    label: str
    num_requests: int
    num_ok: int
    wall_s: float
    requests_per_s: float
    tokens_per_s: float
    tokens_per_request: float
    ttft_p50_ms: float | None
    model_ttft_p50_ms: float | None
    decode_tokens_per_s_p50: float | None
    mean_batch_size: float | None
    vision_p50_ms: float | None = None
    prompt_tokens_p50: float | None = None
    vram_nvml_peak_mib: float | None = None
    torch_max_allocated_mib: float | None = None
    errors: list[str] = field(default_factory=list)


def make_row(label: str, answers: list[Answer], wall_s: float) -> Row:
    ok = [a for a in answers if a.is_ok]
    tokens = sum(a.completion_tokens for a in ok)
    batches = [a.batch_size for a in ok if isinstance(a.batch_size, int)]

    def p50(values: list[float | None]) -> float | None:
        found = [v for v in values if v is not None]
        return None if not found else round(median(found), 1)
    return Row(label, len(answers), len(ok), round(wall_s, 3), round(len(ok) / wall_s, 3) if wall_s else 0.0,
               round(tokens / wall_s, 1) if wall_s else 0.0, round(tokens / max(1, len(ok)), 1),
               p50([a.ttft_ms for a in ok]), p50([a.model_ttft_ms for a in ok]),
               p50([a.decode_tokens_per_s for a in ok]),
               round(sum(batches) / len(batches), 2) if batches else None,
               p50([a.vision_ms for a in ok]), p50([a.prompt_tokens or None for a in ok]),
               errors=sorted({a.error for a in answers if not a.is_ok})[:3])


# ---------------------------------------------------------------- the engine in this process

def measure_in_process(family: Family, built: BuiltModel, model, processor, plan: Plan, device) -> Row:
    """The worker's engine for this family, here, on a batch of `plan.num_concurrent` prepared requests (no HTTP,
    no queue): the ceiling, and torch.cuda.max_memory_allocated over the batch (weights included)."""
    import torch

    from inference_worker.engines import EngineOptions
    from inference_worker.engines.hf.loading import LoadedModel
    from inference_worker.protocol import parse_chat_request

    options = EngineOptions(device=plan.device, dtype="bf16", num_threads=plan.worker_threads or None)
    loaded = LoadedModel(model, processor, family.loaded_family, built.folder, str(built.folder), device,
                         model.dtype, model.config._attn_implementation)
    module, name = family.make_engine.split(":")
    engine = getattr(importlib.import_module(module), name)(loaded, options)
    try:
        requests = [parse_chat_request(json.loads(body)) for body in
                    request_bodies(str(built.folder), f"{family.key}-in-process", plan.num_concurrent, plan.max_tokens)]
        prepared = [engine.prepare(r) for r in requests]
        run_on_engine(engine, prepared[:1])                               # warm-up: kernels, allocator
        is_cuda = device.type == "cuda"
        if is_cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        started = time.perf_counter()
        answers = run_on_engine(engine, prepared)
        row = make_row(f"{family.title} - in-process batch of {len(prepared)}", answers,
                       time.perf_counter() - started)
        if is_cuda:
            row.torch_max_allocated_mib = round(torch.cuda.max_memory_allocated(device) / MIB, 1)
        return row
    finally:
        engine.close()


def run_on_engine(engine, prepared: list) -> list[Answer]:
    answers: list[Answer | None] = [None] * len(prepared)

    def on_done(index: int, outcome) -> None:
        answers[index] = Answer(False, error=f"{type(outcome).__name__}: {outcome}") \
            if isinstance(outcome, Exception) else Answer.of_completion(outcome)
    engine.run_batch(prepared, on_done)
    return [a or Answer(False, error="no answer") for a in answers]


def build_folder(family: Family, plan: Plan, work_dir: Path) -> tuple[BuiltModel, dict]:
    """Write the folder, build the model on the device, save its weights, measure its engine in this process;
    the model is freed before returning (the worker needs the GPU next)."""
    import torch

    from inference_worker.engines.hf.loading import attention_implementation

    device = torch.device(plan.device)
    folder = work_dir / family.key
    started = time.perf_counter()
    fixture = family.write_folder(folder, plan)
    real_params = family.real_params(folder, fixture)
    model, processor = family.build(folder, device, torch.bfloat16, attention_implementation(device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    built = BuiltModel(family.key, family.title, folder, sum(p.numel() for p in model.parameters()),
                       int(model.get_output_embeddings().weight.shape[0]), len(processor.tokenizer),
                       str(model.dtype).removeprefix("torch."), sizes_in_words(family, plan),
                       real_params, family.expected_real_params, family.real_params_of,
                       build_s=round(time.perf_counter() - started, 1))
    started = time.perf_counter()
    model.save_pretrained(folder)
    built.save_s = round(time.perf_counter() - started, 1)
    in_process: dict = {"weights_mib": round(torch.cuda.memory_allocated(device) / MIB, 1)
                        if device.type == "cuda" else None}
    try:
        in_process["row"] = asdict(measure_in_process(family, built, model, processor, plan, device))
    except Exception as exc:  # noqa: BLE001 - reported; the worker part still runs
        in_process["error"] = f"{type(exc).__name__}: {exc}"[:500]
    del model, processor
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    print(f"{family.title}: {built.num_params:,} parameters ({built.sizes}), built in {built.build_s} s, "
          f"saved in {built.save_s} s")
    return built, in_process


# ---------------------------------------------------------------- the worker

@contextlib.contextmanager
def running_worker(built: BuiltModel, plan: Plan, work_dir: Path) -> Iterator[tuple[Endpoint, Any]]:
    """`deskeye-worker` (a subprocess, tests/fixtures/worker.py) serving the folder; stopped on every exit path."""
    import pytest

    from tests.fixtures.worker import start_worker

    args = ["--engine", "transformers", "--model", str(built.folder), "--device", plan.device, "--dtype", "bf16",
            "--max-batch-size", str(plan.num_concurrent), "--threads", str(plan.worker_threads)]
    try:
        handle = start_worker(args, work_dir / f"worker-{built.key}", timeout_s=plan.worker_start_timeout_s)
    except pytest.fail.Exception as exc:     # the fixture reports a worker that did not start this way
        raise WorkerDidNotStart(str(exc)[-2000:]) from None
    try:
        yield Endpoint(f"deskeye-worker {built.key}", handle.host, handle.port, str(built.folder), handle.api_key,
                       handle.log_path), handle
    finally:
        handle.stop()


class WorkerDidNotStart(RuntimeError):
    """The worker exited or never became healthy; the message holds its log's end."""


def serve_and_measure(family: Family, built: BuiltModel, plan: Plan, work_dir: Path, nvml: Nvml) -> dict:
    """The worker on the folder: one at a time, then concurrent clients; the empty_cache counter over both; the
    load window (MiniCPM-V 4.6 only); NVML's view of GPU memory while it ran."""
    baseline_used = nvml.used_bytes()
    result: dict[str, Any] = {}
    started = time.perf_counter()
    with NvmlSampler(nvml) as sampler, running_worker(built, plan, work_dir) as (endpoint, handle):
        result["start_s"] = round(time.perf_counter() - started, 1)
        model = endpoint.model
        warm_up = post_one(endpoint, json.loads(request_bodies(model, f"{family.key}-warm-up", 1, plan.max_tokens)[0]))
        result["warm_up_ok"] = warm_up.is_ok
        before = fetch_metrics(endpoint) or {}
        one_bodies = request_bodies(model, f"{family.key}-one", plan.num_one_at_a_time, plan.max_tokens)
        replies, wall_s = run_closed_loop(endpoint, one_bodies, 1)
        rows = [make_row(f"{family.title} - one at a time", [Answer.of_reply(r) for r in replies], wall_s)]
        concurrent_bodies = request_bodies(model, f"{family.key}-concurrent", plan.num_concurrent, plan.max_tokens)
        sampler.reset_utilisation()
        replies, wall_s = run_closed_loop(endpoint, concurrent_bodies, plan.num_concurrent)
        rows.append(make_row(f"{family.title} - {plan.num_concurrent} concurrent",
                             [Answer.of_reply(r) for r in replies], wall_s))
        after = fetch_metrics(endpoint) or {}
        result["empty_cache"] = counter_rise(before, after)
        concurrent_window = window_reading(after)
        concurrent_window["nvml_utilisation_peak_percent"] = sampler.peak_utilisation
        if family.measures_window:
            result["load_window"] = measure_load_window(endpoint, plan, nvml, concurrent_window)
        result["worker_nvml_log"] = [line.strip()[:300] for line in handle.log_text().splitlines() if "NVML" in line]
    peak = sampler.peak_used_bytes
    vram_mib = None if peak is None or baseline_used is None else round((peak - baseline_used) / MIB, 1)
    for row in rows:
        row.vram_nvml_peak_mib = vram_mib
    result["vram"] = {"nvml_baseline_mib": None if baseline_used is None else round(baseline_used / MIB, 1),
                      "nvml_peak_used_mib": None if peak is None else round(peak / MIB, 1),
                      "nvml_worker_peak_mib": vram_mib,
                      "note": "GPU memory in use on the device while the worker ran, less what was in use before it "
                              "started" if nvml.is_available else f"not measured: NVML unavailable ({nvml.reason})"}
    result["rows"] = [asdict(r) for r in rows]
    result["throughput_ratio"] = ratio(rows[1].requests_per_s, rows[0].requests_per_s)
    return result


def counter_rise(before: dict, after: dict) -> dict:
    """How much the worker's empty_cache counter and its model calls rose between two /metrics readings."""
    def rise(key: str) -> float | None:
        return None if key not in after else after[key] - before.get(key, 0.0)
    return {"empty_cache_calls": rise(EMPTY_CACHE_TOTAL), "model_calls": rise(MODEL_CALLS_TOTAL),
            "series": [EMPTY_CACHE_TOTAL, MODEL_CALLS_TOTAL]}


def window_reading(metrics: dict | None) -> dict:
    """The wait window the worker chose for its last batch and the load it chose it from (its /metrics)."""
    metrics = metrics or {}
    window_s = metrics.get(BATCH_WINDOW_S)
    return {"window_ms": None if window_s is None else round(window_s * 1000, 1),
            "load_percent": None if metrics.get(LOAD_PERCENT) is None else round(metrics[LOAD_PERCENT], 1)}


def measure_load_window(endpoint: Endpoint, plan: Plan, nvml: Nvml, concurrent: dict) -> dict:
    """The window of a lone request with the worker idle, then (on a GPU with NVML) of a lone request while this
    process keeps the GPU busy; `concurrent` is the window of the concurrent clients' batch."""
    model = endpoint.model
    result: dict[str, Any] = {"idle": lone_request_window(endpoint, model, "idle", plan.max_tokens, nvml),
                              "concurrent": concurrent, "gpu_busy": None, "moved": None}
    utilisation = nvml.utilisation_percent() if nvml.is_available else None
    if plan.is_dry or utilisation is None:
        why = f"NVML: {nvml.reason}" if utilisation is None else \
            "dry run on the CPU: the worker reads NVML only for a model on CUDA"
        result.update(measured=False, note=f"no GPU: load window not measured ({why})")
        return result
    with gpu_kept_busy(plan.device):
        busy = lone_request_window(endpoint, model, "gpu-busy", plan.max_tokens, nvml)
    result.update(gpu_busy=busy, measured=True,
                  moved=None if None in (busy["window_ms"], result["idle"]["window_ms"]) else
                  busy["window_ms"] > result["idle"]["window_ms"],
                  note="a lone request each time: the worker's in-process load is the same, so the GPU's "
                       "utilisation (NVML) is what moves the window")
    return result


def lone_request_window(endpoint: Endpoint, model: str, name: str, max_tokens: int, nvml: Nvml) -> dict:
    """One request once the worker's load horizon has passed without a batch, the window it got, and the GPU's
    utilisation (NVML, None without it) as the request was sent."""
    time.sleep(LOAD_HORIZON_S + 0.5)
    utilisation = nvml.utilisation_percent()
    reply = post_one(endpoint, json.loads(request_bodies(model, f"window-{name}", 1, max_tokens)[0]))
    return {**window_reading(fetch_metrics(endpoint)), "nvml_utilisation_percent": utilisation,
            "request_ok": reply.is_ok}


def ratio(measured: float | None, baseline: float | None) -> float | None:
    return None if not measured or not baseline else round(measured / baseline, 2)


# ---------------------------------------------------------------- checks, table

def checks_for(report: dict) -> list[dict]:
    """What must hold, each with the numbers it was judged on."""
    checks = []

    def check(name: str, ok: bool | None, detail: str) -> None:
        checks.append({"check": name, "ok": ok, "detail": detail})
    is_dry = report["mode"] == "dry"
    for key, part in report["models"].items():
        title = part["title"]
        if "error" in part:
            check(f"{title}: measured", False, part["error"])
            continue
        check(f"{title}: real size", part["real_params"] == part["expected_real_params"],
              f"{part['real_params']:,} parameters in {part['real_params_of']} (expected "
              f"{part['expected_real_params']:,}; built on the meta device from the config this check writes)")
        rows = part["worker"]["rows"] + ([part["in_process"]["row"]] if "row" in part["in_process"] else [])
        bad = [f"{r['label']}: {r['num_ok']}/{r['num_requests']} {'; '.join(r['errors'])}" for r in rows
               if r["num_ok"] != r["num_requests"] or r["tokens_per_request"] < 1]
        if "error" in part["in_process"]:
            bad.append(f"in-process: {part['in_process']['error']}")
        check(f"{title}: every request answered", not bad, "; ".join(bad) or f"{len(rows)} rows, all answered")
        concurrent = part["worker"]["rows"][1]
        check(f"{title}: concurrent requests decoded together", (concurrent["mean_batch_size"] or 0) > 1,
              f"mean batch size {concurrent['mean_batch_size']}")
        calls = part["worker"]["empty_cache"]
        empty, model_calls = calls["empty_cache_calls"], calls["model_calls"]
        if is_dry:
            check(f"{title}: no empty_cache without CUDA", empty == 0 and (model_calls or 0) > 0,
                  f"{fmt(empty, 0)} empty_cache calls over {fmt(model_calls, 0)} model calls")
        else:
            check(f"{title}: empty_cache after every model call",
                  empty is not None and model_calls is not None and model_calls > 0 and empty >= model_calls,
                  f"{EMPTY_CACHE_TOTAL} +{fmt(empty, 0)} over {fmt(model_calls, 0)} model calls ({MODEL_CALLS_TOTAL})")
            allocated = part["in_process"].get("row", {}).get("torch_max_allocated_mib")
            weights = part["in_process"].get("weights_mib")
            check(f"{title}: torch peak memory measured", allocated is not None and weights is not None
                  and allocated >= weights, f"max_memory_allocated {fmt(allocated)} MiB, weights {fmt(weights)} MiB")
        window = part["worker"].get("load_window")
        if window is not None and window.get("measured"):
            check(f"{title}: GPU load moves the batch window", bool(window["moved"]),
                  f"idle {fmt(window['idle']['window_ms'])} ms -> GPU busy {fmt(window['gpu_busy']['window_ms'])} ms")
    if not is_dry:
        check(f"whole check within {GPU_BUDGET_S:.0f} s", report["wall_s"] <= GPU_BUDGET_S, f"{report['wall_s']} s")
    return checks


TABLE_NOTE = ("ttft ms = request arrival -> first token in the worker (p50); model ttft = joining the decode -> first "
              "token (vision + prefill), vision ms its image part where the engine reports it; dec tok/s = one row's "
              "decode speed (p50); batch = rows decoded with each request; vram = GPU memory NVML saw in use while "
              "the worker ran, less before; torch = torch.cuda.max_memory_allocated over the in-process batch, "
              "weights included")
TABLE_COLUMNS = (("requests", 9), ("req/s", 8), ("tok/s", 8), ("ttft ms", 9), ("model ttft", 11),
                 ("vision ms", 10), ("dec tok/s", 10), ("batch", 7), ("vram MiB", 10), ("torch MiB", 10))


def print_report(report: dict) -> None:
    print(f"\nGPU check ({report['mode']}): {report['device']['name']}, torch {report['device']['torch']}, "
          f"transformers {report['device']['transformers']}, {report['max_tokens']} tokens per request, "
          f"800x600 frames; linear-attention kernels: {report['device']['linear_attention_kernels']}")
    header = f"{'row':<42}" + "".join(f"{name:>{width}}" for name, width in TABLE_COLUMNS)
    print(header)
    print("-" * len(header))
    for part in report["models"].values():
        rows = part.get("worker", {}).get("rows", []) + \
            ([part["in_process"]["row"]] if "row" in part.get("in_process", {}) else [])
        for r in rows:
            cells = (f"{r['num_ok']}/{r['num_requests']}", fmt(r["requests_per_s"], 2), fmt(r["tokens_per_s"]),
                     fmt(r["ttft_p50_ms"]), fmt(r["model_ttft_p50_ms"]), fmt(r["vision_p50_ms"]),
                     fmt(r["decode_tokens_per_s_p50"]),
                     fmt(r["mean_batch_size"], 2), fmt(r["vram_nvml_peak_mib"], 0),
                     fmt(r["torch_max_allocated_mib"], 0))
            print(f"{r['label'][:41]:<42}" + "".join(f"{c:>{w}}" for c, (_, w) in zip(cells, TABLE_COLUMNS)))
    print(TABLE_NOTE)
    for part in report["models"].values():
        print(f"\n{part['title']}: {part.get('sizes', '')}")
        if "error" in part:
            print(f"  not measured: {part['error']}")
            continue
        worker = part["worker"]
        calls = worker["empty_cache"]
        print(f"  {part['num_params']:,} parameters, {part['vocab_rows']:,}-row output head, tokenizer "
              f"{part['tokenizer_size']:,} tokens, {part['dtype']}; built {part['build_s']} s, saved "
              f"{part['save_s']} s, worker ready in {worker['start_s']} s")
        print(f"  at the real size: {part['real_params']:,} parameters in {part['real_params_of']}")
        print(f"  {report['num_concurrent']} concurrent vs one at a time: {fmt(worker['throughput_ratio'], 2)}x "
              "requests/s")
        print(f"  empty_cache calls: +{fmt(calls['empty_cache_calls'], 0)} over {fmt(calls['model_calls'], 0)} "
              f"model calls ({EMPTY_CACHE_TOTAL}, {MODEL_CALLS_TOTAL})")
        print_vram(part["in_process"], worker["vram"])
        window = worker.get("load_window")
        if window is not None:
            busy = window["gpu_busy"]
            idle = window["idle"]
            print(f"  load window: idle {fmt(idle['window_ms'])} ms (load {fmt(idle['load_percent'])} %, NVML "
                  f"{fmt(idle['nvml_utilisation_percent'])} %), "
                  f"{report['num_concurrent']} concurrent {fmt(window['concurrent']['window_ms'])} ms (load "
                  f"{fmt(window['concurrent']['load_percent'])} %)" +
                  (f", GPU busy {fmt(busy['window_ms'])} ms (load {fmt(busy['load_percent'])} %, NVML "
                   f"{fmt(busy['nvml_utilisation_percent'])} %)" if busy else ""))
            print(f"  {window['note']}")
    print("\nchecks:")
    for c in report["checks"]:
        print(f"  {'PASS' if c['ok'] else 'FAIL'}  {c['check']}: {c['detail']}")


def print_vram(in_process: dict, vram: dict) -> None:
    weights = in_process.get("weights_mib")
    allocated = in_process.get("row", {}).get("torch_max_allocated_mib")
    torch_part = "no CUDA" if weights is None else \
        f"max_memory_allocated {fmt(allocated, 0)} MiB over the in-process batch (weights {fmt(weights, 0)} MiB)"
    nvml_part = vram["note"] if vram["nvml_worker_peak_mib"] is None else \
        f"{fmt(vram['nvml_worker_peak_mib'], 0)} MiB for the worker ({fmt(vram['nvml_peak_used_mib'], 0)} MiB in " \
        f"use at the peak, {fmt(vram['nvml_baseline_mib'], 0)} before it started)"
    print(f"  VRAM: torch {torch_part}; NVML {nvml_part}")


# ---------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry", action="store_true",
                        help="tiny sizes on the CPU, the same code (CI; no GPU needed, about a minute)")
    parser.add_argument("--only", choices=[f.key for f in FAMILIES], action="append",
                        help="measure only this model (may be given twice; default both)")
    parser.add_argument("--max-tokens", type=int, default=0,
                        help="tokens per request (default 64 on the GPU, 8 with --dry)")
    parser.add_argument("--small-vision", action="store_true",
                        help="MiniCPM-o stand-in with a tiny vision tower instead of the real-size one")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="where the model folders go (default /dev/shm when it has room, else the temp dir)")
    parser.add_argument("--json-out", type=Path, default=None,
                        help="where the JSON goes (default benchmarks/results/gpu_check.json; "
                             "gpu_check-dry.json with --dry)")
    args = parser.parse_args(argv)
    if args.max_tokens < 0:
        parser.error("--max-tokens must be at least 1 (or 0 for the default)")
    if args.json_out is None:
        args.json_out = RESULTS_DIR / ("gpu_check-dry.json" if args.dry else "gpu_check.json")
    return args


def cuda_missing_reason() -> str:
    """Why this machine cannot run the GPU check ("" when it can)."""
    import torch

    if torch.cuda.is_available():
        return ""
    build = "a CPU-only build" if torch.version.cuda is None else \
        f"built for CUDA {torch.version.cuda}, no GPU or driver"
    return (f"benchmarks.gpu_check needs a CUDA GPU, but PyTorch {torch.__version__} ({build}) sees none. Run it on a "
            "GPU machine (see the setup line in this module's docstring), or pass --dry for the tiny CPU run.")


def device_facts(plan: Plan) -> dict:
    import torch
    import transformers

    kernels = [name for name in ("fla", "causal_conv1d") if importlib.util.find_spec(name) is not None]
    return {"name": torch.cuda.get_device_name(0) if plan.device == "cuda" else "CPU (dry run)",
            "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
            "cpu_count": os.cpu_count(), "flash_attn": importlib.util.find_spec("flash_attn") is not None,
            "linear_attention_kernels": ", ".join(kernels) or "none (transformers' PyTorch path)"}


def default_work_dir(plan: Plan) -> Path:
    """/dev/shm when it can hold the largest folder (MiniCPM-o's ~18 GB in bf16): no disk on the clock."""
    shm = Path("/dev/shm")
    if not plan.is_dry and shm.is_dir() and shutil.disk_usage(shm).free > 24 * 1024**3:
        return shm
    return Path(tempfile.gettempdir())


def measure_family(family: Family, plan: Plan, work_dir: Path, nvml: Nvml) -> dict:
    part: dict[str, Any] = {"title": family.title}
    try:
        built, in_process = build_folder(family, plan, work_dir)
        part.update({k: v for k, v in asdict(built).items() if k not in ("folder", "key", "title")},
                    in_process=in_process)
        part["worker"] = serve_and_measure(family, built, plan, work_dir, nvml)
    except Exception as exc:  # noqa: BLE001 - one model's failure is reported; the other is still measured
        traceback.print_exc()
        part["error"] = f"{type(exc).__name__}: {exc}"[-2000:]
    finally:
        shutil.rmtree(work_dir / family.key, ignore_errors=True)
    return part


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = plan_for(args)
    if not plan.is_dry and (reason := cuda_missing_reason()):
        print(f"error: {reason}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    nvml = Nvml()
    report: dict[str, Any] = {"benchmark": "gpu_check", "mode": "dry" if plan.is_dry else "gpu",
                              "device": device_facts(plan), "max_tokens": plan.max_tokens,
                              "num_one_at_a_time": plan.num_one_at_a_time, "num_concurrent": plan.num_concurrent,
                              "nvml": {"available": nvml.is_available, "reason": nvml.reason}, "models": {}}
    try:
        work_dir = args.work_dir or default_work_dir(plan)
        with tempfile.TemporaryDirectory(prefix="deskeye-gpu-check-", dir=work_dir) as tmp:
            for family in FAMILIES:
                if not args.only or family.key in args.only:
                    report["models"][family.key] = measure_family(family, plan, Path(tmp), nvml)
    finally:
        nvml.close()
    report["wall_s"] = round(time.perf_counter() - started, 1)
    report["checks"] = checks_for(report)
    print_report(report)
    print()
    write_result(args.json_out, report)
    return 0 if all(c["ok"] for c in report["checks"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
