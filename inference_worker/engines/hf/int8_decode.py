"""Decode steps on the CPU from int8 copies of the text model's weights.

A decode step multiplies one token per row by every weight of the text model and its output head: on a CPU it is
bound by how fast the weights stream from memory, not by arithmetic. MiniCPM-V 4.6 in bf16 reads ~1.5 GB a token
(the 248k-row head alone 0.5 GB). An int8 copy of each text-model matrix (one scale per output row, symmetric) is
half of that, and torch's int8 weight kernel (`_weight_int8pack_mm`) multiplies it directly: in bf16 a decode step
of the real-size model took ~0.65x the time (benchmarks.real_size, "bf16" beside "bf16/model"). With float32 inputs
the same kernel was 2.3x slower than the model's float32 weights, so `auto` makes the copies for bf16 models only. The copies serve decode steps only
(`decode_steps()`, entered by ModelForward.step), whatever the number of rows, so a row's tokens do not depend on
the rows batched with it. The model's own weights stay and serve everything else - prefill, the first token, the
vision tower - where many rows go through each matrix and a bf16 matrix product is faster than the int8 kernel.

The copies cost one byte per text-model parameter (0.75 GB for MiniCPM-V 4.6). Each output differs from the
model's own by the rounding of its weights (at most half a step of 1/127 of the row's largest weight): the
`decode_weights` setting keeps "model" for whoever wants the model's exact arithmetic.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass
from typing import Any, Iterator

log = logging.getLogger(__name__)

CHOICES = ("auto", "int8", "model")
#: "auto" makes the copies only when the memory available holds them this many times over
AUTO_MEMORY_FACTOR = 2
#: ... and only for text models this big: smaller matrices stay in the CPU's caches, where a step is not bound by
#: reading the weights from memory (the same line as loading.MIN_CPU_BF16_PARAMS)
MIN_AUTO_PARAMS = 100_000_000
MEMINFO_PATH = "/proc/meminfo"
#: rows quantized at a time: 4096 rows of a 1024-wide matrix are a 16 MB float32 working copy
ROWS_PER_PIECE = 4096


@dataclass(frozen=True)
class Int8Copies:
    """What `add_int8_copies` did."""
    num_matrices: int
    num_bytes: int


def _int8_linear_class():
    import torch
    from torch import nn

    class Int8DecodeLinear(nn.Linear):
        """An nn.Linear that also holds its weight as int8 rows with one scale each, and multiplies by that copy
        in decode steps (on the CPU, in the scales' dtype)."""

        weight_int8: torch.Tensor
        weight_scale: torch.Tensor

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            num_rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
            if (not getattr(_phase, "decoding", False) or num_rows == 0 or x.dtype != self.weight_scale.dtype
                    or x.device.type != "cpu"):
                return super().forward(x)
            out = torch.ops.aten._weight_int8pack_mm(x.reshape(num_rows, x.shape[-1]), self.weight_int8,
                                                      self.weight_scale)
            if self.bias is not None:
                out = out + self.bias
            return out.reshape(*x.shape[:-1], out.shape[-1])

    return Int8DecodeLinear


_CLASS: Any = None
_phase = threading.local()


@contextlib.contextmanager
def decode_steps() -> Iterator[None]:
    """Forwards inside use the int8 copies (of modules that have them); on this thread only."""
    before = getattr(_phase, "decoding", False)
    _phase.decoding = True
    try:
        yield
    finally:
        _phase.decoding = before


def int8_linear_class():
    """The nn.Linear subclass (made on first use: no torch at import time)."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _int8_linear_class()
    return _CLASS


def quantize_rows(weight, *, rows_per_piece: int = ROWS_PER_PIECE) -> tuple[Any, Any]:
    """(int8 weight, scale per row in the weight's dtype): symmetric, the row's largest |w| maps to 127. Done
    `rows_per_piece` rows at a time, so the float32 working copy stays small (a 248k-row head whole would take
    1 GB more at its peak)."""
    import torch

    num_rows = weight.shape[0]
    q = torch.empty(weight.shape, dtype=torch.int8)
    scale = torch.empty(num_rows, dtype=torch.float32)
    with torch.no_grad():
        for start in range(0, num_rows, rows_per_piece):
            piece = weight[start:start + rows_per_piece].detach().to(torch.float32, copy=True)   # never in place
            piece_scale = piece.abs().amax(dim=1).clamp_(min=torch.finfo(torch.float32).tiny).div_(127.0)
            q[start:start + rows_per_piece] = piece.div_(piece_scale[:, None]).round_().clamp_(-127, 127)
            scale[start:start + rows_per_piece] = piece_scale
    return q, scale.to(weight.dtype)


def text_linears(model: Any) -> Iterator[Any]:
    """The text model's nn.Linear modules and its output head, each once; not the vision tower's."""
    from torch import nn

    text = getattr(model, "llm", None)                       # MiniCPM-o: the inner Qwen3, head included
    if not isinstance(text, nn.Module):
        text = getattr(getattr(model, "model", None), "language_model", None)     # transformers' VLMs
    if not isinstance(text, nn.Module) and hasattr(model, "get_decoder"):
        text = model.get_decoder()
    seen: set[int] = set()
    parts = [text] if isinstance(text, nn.Module) else []
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, nn.Module):
        parts.append(head)
    for part in parts:
        for module in part.modules():
            if type(module) is nn.Linear and id(module) not in seen:
                seen.add(id(module))
                yield module


def add_int8_copies(model: Any) -> Int8Copies:
    """Give each text-model nn.Linear of `model` (on the CPU) an int8 copy of its weight, used for decode steps.
    The modules stay where they are, with their own weights (tied weights stay tied)."""
    linear_class = int8_linear_class()
    num_matrices = num_bytes = 0
    for module in list(text_linears(model)):
        if module.weight.device.type != "cpu":
            continue
        q, scale = quantize_rows(module.weight)
        module.__class__ = linear_class
        module.register_buffer("weight_int8", q, persistent=False)
        module.register_buffer("weight_scale", scale, persistent=False)
        num_matrices += 1
        num_bytes += q.numel() + scale.numel() * scale.element_size()
    return Int8Copies(num_matrices, num_bytes)


def text_weight_count(model: Any) -> int:
    """Parameters the int8 copies would hold (one byte each)."""
    return sum(module.weight.numel() for module in text_linears(model))


def available_memory_bytes(meminfo_text: str | None = None) -> int | None:
    """MemAvailable from /proc/meminfo, in bytes; None where it cannot be read."""
    try:
        text = meminfo_text if meminfo_text is not None else open(MEMINFO_PATH, encoding="ascii").read()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                return int(parts[1]) * 1024
    return None


def resolve_decode_weights(choice: str, device: Any, model: Any, *, dtype: Any = None,
                           memory_bytes: int | None = None) -> str:
    """'int8' or 'model' for `choice` (one of CHOICES) on `device`, the model's weights being `dtype`. auto: int8
    on the CPU for a bf16 text model of MIN_AUTO_PARAMS or more when the memory available holds the copies
    AUTO_MEMORY_FACTOR times over (with float32 inputs torch's int8 kernel was 2.3x slower than the model's own
    float32 weights: benchmarks.real_size, "fp32" beside "fp32/model"); int8 asked for on a GPU is an error."""
    from inference_worker.engines.hf.model_files import ModelLoadError

    if choice not in CHOICES:
        raise ModelLoadError(f"decode_weights must be one of {', '.join(CHOICES)}; got {choice!r}.")
    on_cpu = getattr(device, "type", str(device)) == "cpu"
    if choice == "int8" and not on_cpu:
        raise ModelLoadError("--decode-weights int8 is for the CPU (torch's int8 weight kernel); on a GPU use "
                             "--decode-weights model, or auto.")
    if choice != "auto":
        return choice
    num_params = text_weight_count(model)
    if not on_cpu or num_params < MIN_AUTO_PARAMS or str(dtype) != "torch.bfloat16":
        return "model"
    needed = num_params * AUTO_MEMORY_FACTOR
    available = available_memory_bytes() if memory_bytes is None else memory_bytes
    if available is not None and available < needed:
        log.warning("decode from the model's own weights: the int8 copies (%.1f GB) need %.1f GB of free memory, "
                    "%.1f GB is available", needed / AUTO_MEMORY_FACTOR / 1e9, needed / 1e9, available / 1e9)
        return "model"
    return "int8"
