"""Load a vision-language model: device, dtype, attention, enough GPU memory, then the family's parts loader.

Every way loading can fail that a user can fix (a missing or incomplete folder, a Hub id while offline: model_files.py;
too little GPU memory) becomes a `ModelLoadError` whose message says what is wrong and what to do.
`load_model` returns a `LoadedModel`; which parts loader runs is the caller's FAMILIES entry (engines/__init__.py),
so this module imports no engine.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from inference_worker.engines.hf.int8_decode import add_int8_copies, resolve_decode_weights
from inference_worker.engines.hf.model_files import (ModelLoadError, check_model_folder, checkpoint_weight_bytes,
                                                     num_checkpoint_params, resolve_model_path)

log = logging.getLogger(__name__)

DEVICES = ("auto", "cuda", "cpu")
DTYPES = ("auto", "bf16", "fp16", "fp32")
GB = 1_000_000_000
#: activations, KV cache and the CUDA context on top of the weights
VRAM_HEADROOM_FRACTION = 0.10
MIN_VRAM_HEADROOM_BYTES = 1 * GB

#: (minimum free VRAM in bytes, model id, what it is) — FIELD_NOTES' table, biggest first
MODEL_BY_VRAM = (
    (20 * GB, "openbmb/MiniCPM-o-4_5", "MiniCPM-o 4.5 in bf16, ~19 GB"),
    (11 * GB, "openbmb/MiniCPM-o-4_5-AWQ", "MiniCPM-o 4.5 in 4-bit AWQ, ~11 GB"),
    (5 * GB, "openbmb/MiniCPM-V-4.6", "MiniCPM-V 4.6, ~4 GB in bf16"),
)
CPU_MODEL = "openbmb/MiniCPM-V-4.6"
#: MiniCPM-o weights the worker does not load (init_audio=False, init_tts=False): audio tower and TTS
MINICPMO_UNLOADED_PREFIXES = ("apm.", "tts.", "audio_")
#: /proc/cpuinfo flags of a CPU that multiplies bf16 natively (Intel AMX; AVX-512 BF16 on Intel and AMD Zen 4+).
#: There MiniCPM-V 4.6 in bf16 ran its vision tower 4-5x faster than in fp32 and its answer ~2x faster (README);
#: without them bf16 is emulated and slower than fp32.
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
#: below this many parameters a CPU stays in fp32 even with those flags: matrices too small for the bf16 units to
#: pay (the tiny test models decoded 18-32% slower in bf16 on an AMX CPU), and fp32 keeps them exact
MIN_CPU_BF16_PARAMS = 100_000_000
CPUINFO_PATH = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class LoadSpec:
    model: str                 # a local folder or a Hugging Face Hub id
    device: str = "auto"       # auto | cuda | cpu
    dtype: str = "auto"        # auto | bf16 | fp16 | fp32
    kv_cache_bytes: int = 0    # the frame KV budget the engine will fill: counted in the VRAM check
    decode_weights: str = "model"   # auto | int8 | model: int8_decode.py

    def __post_init__(self):
        if not self.model or not self.model.strip():
            raise ModelLoadError("No model given: pass a local model folder or a Hub id such as "
                                 "openbmb/MiniCPM-V-4.6.")
        if self.device not in DEVICES:
            raise ModelLoadError(f"device must be one of {', '.join(DEVICES)}; got {self.device!r}.")
        if self.dtype not in DTYPES:
            raise ModelLoadError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}.")
        if self.kv_cache_bytes < 0:
            raise ModelLoadError(f"kv_cache_bytes must be >= 0 (0 = no frame KV); got {self.kv_cache_bytes}.")


@dataclass
class LoadedModel:
    model: Any                 # the torch module
    processor: Any             # AutoProcessor (transformers families) or the tokenizer (MiniCPM-o)
    family: str                # the FAMILIES entry's name: "transformers" | "minicpmv4_6" | "minicpmo"
    path: Path
    name: str                  # what the user asked for (folder or Hub id)
    device: Any                # torch.device
    dtype: Any                 # torch.dtype
    attn_implementation: str
    decode_weights: str = "model"   # what decode steps multiply by: "int8" copies or the "model"'s own weights


# ---------------------------------------------------------------- how much memory it needs

def required_vram_bytes(weight_bytes: int, kv_cache_bytes: int = 0) -> int:
    """Weights, working memory (activations, CUDA context) and the frame KV budget the engine may fill."""
    return weight_bytes + max(MIN_VRAM_HEADROOM_BYTES, int(weight_bytes * VRAM_HEADROOM_FRACTION)) + kv_cache_bytes


def model_for_vram(free_bytes: int) -> tuple[str, str] | None:
    """(model id, description) of the biggest DeskEye model that fits in `free_bytes`, or None."""
    for min_bytes, model_id, what in MODEL_BY_VRAM:
        if free_bytes >= min_bytes:
            return model_id, what
    return None


def check_fits_vram(model: str, *, required_bytes: int, free_bytes: int, total_bytes: int,
                    kv_cache_bytes: int = 0) -> None:
    """Raise ModelLoadError when the model needs more GPU memory than is free, naming one that fits."""
    if required_bytes <= free_bytes:
        return
    if kv_cache_bytes and required_bytes - kv_cache_bytes <= free_bytes:
        raise ModelLoadError(
            f"Not enough GPU memory for {model} with its frame KV budget: the model needs about "
            f"{(required_bytes - kv_cache_bytes) / GB:.1f} GB and the KV budget {kv_cache_bytes / GB:.1f} GB more, but "
            f"the GPU has {free_bytes / GB:.1f} GB free of {total_bytes / GB:.1f} GB. To fix it, lower the KV budget "
            f"(--kv-cache-mb), or turn frame reuse off (--no-kv-reuse).")
    suggestion = model_for_vram(free_bytes)
    if suggestion and suggestion[0] != model:
        fix = f"use {suggestion[0]} ({suggestion[1]}), or run on the CPU with --device cpu"
    else:
        fix = f"run {CPU_MODEL} on the CPU with --device cpu, or free GPU memory used by other programs"
    raise ModelLoadError(f"Not enough GPU memory for {model}: it needs about {required_bytes / GB:.1f} GB "
                         f"(weights plus working memory) but the GPU has {free_bytes / GB:.1f} GB free of "
                         f"{total_bytes / GB:.1f} GB. To fix it, {fix}.")


# ---------------------------------------------------------------- device, dtype, attention

def resolve_device(device: str):
    import torch

    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ModelLoadError(f"--device cuda was asked for, but PyTorch {torch.__version__} sees no CUDA GPU "
                             "(a CPU-only build, or no driver). Use --device auto or --device cpu.")
    return torch.device("cuda", torch.cuda.current_device())


def resolve_dtype(dtype: str, device, *, num_params: int = 0, cpu_flags: frozenset[str] | None = None):
    """`dtype` by name; "auto": bf16 on a GPU that supports it, else fp16; on a CPU bf16 where it multiplies bf16
    natively (`cpu_has_bf16`) and the model has at least MIN_CPU_BF16_PARAMS parameters, else fp32.
    `cpu_flags` None: this machine's (read_cpu_flags)."""
    import torch

    named = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if dtype != "auto":
        return named[dtype]
    if device.type != "cuda":
        flags = read_cpu_flags() if cpu_flags is None else cpu_flags
        return torch.bfloat16 if num_params >= MIN_CPU_BF16_PARAMS and cpu_has_bf16(flags) else torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def read_cpu_flags(cpuinfo_text: str | None = None) -> frozenset[str]:
    """The CPU's feature flags: the "flags" (x86) or "Features" (Arm) lines of /proc/cpuinfo, or of
    `cpuinfo_text`; empty where there is no such file (not Linux)."""
    if cpuinfo_text is None:
        try:
            cpuinfo_text = CPUINFO_PATH.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return frozenset()
    flags: set[str] = set()
    for line in cpuinfo_text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return frozenset(flags)


def cpu_has_bf16(flags: frozenset[str]) -> bool:
    """Whether a CPU with these flags multiplies bf16 natively (CPU_BF16_FLAGS)."""
    return any(flag in flags for flag in CPU_BF16_FLAGS)

def attention_implementation(device) -> str:
    """flash_attention_2 on CUDA when flash_attn imports, else PyTorch's sdpa."""
    if device.type == "cuda":
        try:
            import flash_attn  # noqa: F401
            return "flash_attention_2"
        except Exception:   # not installed, or built for another torch/CUDA
            pass
    return "sdpa"


# ---------------------------------------------------------------- loading

def load_model(spec: LoadSpec, family_for: Callable[[dict[str, Any]], Any], *, progress: bool = True,
               resolve: Callable[[str], Callable]) -> LoadedModel:
    """Resolve, check and load `spec.model` with the parts loader of `family_for(config.json)` (a FAMILIES entry:
    `.name`, `.load_parts` resolved by `resolve`); every user-fixable failure is a ModelLoadError."""
    path = resolve_model_path(spec.model, progress=progress)
    config = check_model_folder(path)
    device = resolve_device(spec.device)
    is_cpu_auto = spec.dtype == "auto" and device.type != "cuda"
    dtype = resolve_dtype(spec.dtype, device, num_params=num_checkpoint_params(path) if is_cpu_auto else 0)
    family = family_for(config)
    if device.type == "cuda":
        _check_vram(spec, path, device, dtype, family.name)
    attn = attention_implementation(device)
    load_parts = resolve(family.load_parts)
    with _StepBar(f"Loading {spec.model}", ["processor", "weights", f"to {device}"], enabled=progress) as bar:
        model, processor = _call_loader(load_parts, path, dtype=dtype, attn=attn, device=device, step=bar.step)
    decode_weights = resolve_decode_weights(spec.decode_weights, device, model, dtype=dtype)
    if decode_weights == "int8":
        copies = add_int8_copies(model)
        log.info("decode steps multiply by int8 copies of %d text-model matrices (%.2f GB; --decode-weights model "
                 "keeps the model's own)", copies.num_matrices, copies.num_bytes / GB)
    return LoadedModel(model, processor, family.name, path, spec.model, device, dtype, attn, decode_weights)


def _check_vram(spec: LoadSpec, path: Path, device, dtype, family: str) -> None:
    import torch

    skip = MINICPMO_UNLOADED_PREFIXES if family == "minicpmo" else ()
    weight_bytes = checkpoint_weight_bytes(path, itemsize=torch.empty((), dtype=dtype).element_size(),
                                           skip_prefixes=skip)
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    check_fits_vram(spec.model, required_bytes=required_vram_bytes(weight_bytes, spec.kv_cache_bytes),
                    free_bytes=free_bytes, total_bytes=total_bytes, kv_cache_bytes=spec.kv_cache_bytes)


def _call_loader(load_parts: Callable, path: Path, *, dtype, attn: str, device, step: Callable[[], None]):
    try:
        return load_parts(path, dtype=dtype, attn_implementation=attn, device=device, step=step)
    except ModelLoadError:
        raise
    except ValueError as exc:
        if "does not support" in str(exc) and attn != "sdpa":
            return load_parts(path, dtype=dtype, attn_implementation="sdpa", device=device, step=step)
        raise ModelLoadError(f"transformers cannot load {path}: {exc}") from None
    except ImportError as exc:
        raise ModelLoadError(f"{path} needs a Python package that is not installed or does not import: {exc}") \
            from None
    except (OSError, KeyError) as exc:
        raise ModelLoadError(f"The model files in {path} could not be read ({exc}). Download the checkpoint "
                             "again.") from None


def load_transformers_parts(path: Path, *, dtype, attn_implementation: str, device,
                            step: Callable[[], None]):
    """AutoProcessor + AutoModelForImageTextToText: the families transformers supports natively."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    step()
    return load_model_weights(path, processor, dtype=dtype, attn_implementation=attn_implementation, device=device,
                              step=step)


def load_model_weights(path: Path, processor: Any, *, dtype, attn_implementation: str, device,
                       step: Callable[[], None]):
    """AutoModelForImageTextToText from `path` onto `device` (two steps); returns (model, processor)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(
        path, dtype=dtype, attn_implementation=attn_implementation,
        device_map=str(device) if device.type == "cuda" else None)   # straight onto the GPU
    step()
    model = model.to(device).eval()
    time_image_features(model)
    step()
    return model, processor


def time_image_features(model: Any) -> None:
    """Count the seconds the model spends encoding images (its `get_image_features`: vision tower and merger) in
    `model.vision_seconds`, which `vision_seconds` reads: the worker reports each answer's share (deskeye.vision_ms)
    beside its time to first token, so a slow answer shows whether the image or the text took the time. A model
    without `get_image_features` keeps 0."""
    import time

    inner = getattr(model, "model", model)
    encode = getattr(inner, "get_image_features", None)
    model.vision_seconds = 0.0
    if encode is None:
        return

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return encode(*args, **kwargs)
        finally:
            model.vision_seconds += time.perf_counter() - started
    inner.get_image_features = timed       # the instance attribute shadows the method the model's forward calls


def vision_seconds(model: Any) -> float:
    """Seconds `model` has spent encoding images so far (time_image_features); 0 where they are not counted."""
    return float(getattr(model, "vision_seconds", 0.0))


class _StepBar:
    """A tqdm bar on stderr over named loading steps."""

    def __init__(self, title: str, steps: list[str], *, enabled: bool):
        self.title, self.steps, self.enabled = title, steps, enabled
        self.bar = None

    def __enter__(self) -> "_StepBar":
        from tqdm.auto import tqdm

        self.bar = tqdm(total=len(self.steps), desc=f"{self.title}: {self.steps[0]}", file=sys.stderr,
                        disable=not self.enabled, leave=True)
        return self

    def step(self) -> None:
        self.bar.update(1)
        if self.bar.n < len(self.steps):
            self.bar.set_description(f"{self.title}: {self.steps[self.bar.n]}")

    def __exit__(self, *exc) -> None:
        self.bar.close()
