"""Loading MiniCPM-o 4.5 (`openbmb/MiniCPM-o-4_5`), which ships its own modeling code, on transformers 5: its
vision and language parts only (minicpmo.py serves them).

**Loading on transformers 5.** The official remote code (pinned to transformers 4.51) does not load on 5.x as is;
read in OpenBMB/MiniCPM-o-Demo (MiniCPMO45/) and run on a tiny random instance here, it fails in four places,
and `remote_code_compat()`, `_with_post_init` and `restore_position_tables` pass through them while loading:
1. `modeling_navit_siglip.py` imports `transformers.modeling_attn_mask_utils` (removed in 5; the config file
   imports it, so `AutoProcessor.from_pretrained` already fails): a module of that name is provided with the one
   function it imports, `_prepare_4d_attention_mask` (the additive padding mask SigLIP uses for mixed-size slices).
2. transformers' `check_imports` demands `flag_gems`, `librosa`, `soundfile`, which the code imports only behind
   `USE_FLAGOS=1`, for reference audio and for writing speech: they are left out of the check.
3. `MiniCPMO.__init__` never calls `post_init()`, which 5.x's `from_pretrained` needs (`all_tied_weights_keys`):
   the model class is loaded through a subclass that calls it.
4. 5.x builds the model on the meta device and hands every non-persistent buffer to `_init_weights`; the
   resampler's 2-D sin-cos `pos_embed` is one that Qwen3's init does not know, so it is left uninitialised
   memory (silently wrong vision features): it is recomputed with the resampler's own `_set_2d_pos_cache`.
The shim module is removed again after loading (the loaded code keeps its reference). With these, the whole
vision-only path of the official code was run on transformers 5.24 (a tiny random instance of it: processor,
`get_vllm_embedding`, the LM): see the README's MiniCPM-o section.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

#: packages the remote code imports only on paths DeskEye never takes (FlagOS kernels, reference audio, speech out)
OPTIONAL_REMOTE_IMPORTS = frozenset({"flag_gems", "librosa", "soundfile"})
#: removed in transformers 5; the remote modeling_navit_siglip.py imports it
REMOVED_MASK_UTILS = "transformers.modeling_attn_mask_utils"


def is_minicpmo_config(config: dict[str, Any]) -> bool:
    """Whether a checkpoint's config.json is MiniCPM-o's: model_type 'minicpmo', or its own code (auto_map) names
    MiniCPMO (the AWQ build keeps both)."""
    auto_map = config.get("auto_map") or {}
    return config.get("model_type") == "minicpmo" or any("MiniCPMO" in str(v) for v in auto_map.values())


def prepare_4d_attention_mask(mask: torch.Tensor, dtype: torch.dtype, tgt_len: int | None = None) -> torch.Tensor:
    """transformers 4.x's `_prepare_4d_attention_mask`: a (batch, keys) 1/0 padding mask -> the additive
    (batch, 1, queries, keys) mask: 0 where a key is attended, the dtype's minimum where it is padding."""
    batch, num_keys = mask.shape
    num_queries = num_keys if tgt_len is None else tgt_len
    keep = mask[:, None, None, :].expand(batch, 1, num_queries, num_keys).to(torch.bool)
    additive = torch.zeros((batch, 1, num_queries, num_keys), dtype=dtype, device=mask.device)
    return additive.masked_fill(~keep, torch.finfo(dtype).min)


@contextlib.contextmanager
def remote_code_compat() -> Iterator[None]:
    """While loading MiniCPM-o's remote code: provide the removed mask-utils module (only when transformers has
    none) and leave the optional packages out of transformers' import check. Both are undone on exit."""
    from transformers import dynamic_module_utils

    with _mask_utils_module(), _optional_imports_unchecked(dynamic_module_utils):
        yield


@contextlib.contextmanager
def _mask_utils_module() -> Iterator[None]:
    if importlib.util.find_spec(REMOVED_MASK_UTILS) is not None:     # transformers 4.x: the real module
        yield
        return
    shim = types.ModuleType(REMOVED_MASK_UTILS, "DeskEye's stand-in for a module transformers 5 removed")
    shim._prepare_4d_attention_mask = prepare_4d_attention_mask
    sys.modules[REMOVED_MASK_UTILS] = shim
    try:
        yield
    finally:
        if sys.modules.get(REMOVED_MASK_UTILS) is shim:
            del sys.modules[REMOVED_MASK_UTILS]


@contextlib.contextmanager
def _optional_imports_unchecked(dynamic_module_utils) -> Iterator[None]:
    get_imports = dynamic_module_utils.get_imports       # check_imports looks it up at call time

    def required_imports(filename):
        return [name for name in get_imports(filename) if name not in OPTIONAL_REMOTE_IMPORTS]
    dynamic_module_utils.get_imports = required_imports
    try:
        yield
    finally:
        dynamic_module_utils.get_imports = get_imports


def _with_post_init(model_class: type) -> type:
    """`model_class` whose __init__ ends with `post_init()` when the remote one did not call it."""
    class VisionOnly(model_class):
        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            if not hasattr(self, "all_tied_weights_keys"):
                self.post_init()
    VisionOnly.__name__, VisionOnly.__qualname__ = model_class.__name__, model_class.__qualname__
    VisionOnly.__module__ = model_class.__module__
    return VisionOnly


def restore_position_tables(model: Any) -> int:
    """Recompute the resamplers' 2-D position tables (non-persistent buffers that transformers 5's from_pretrained
    leaves uninitialised), on the CPU as at construction; returns how many were restored."""
    resamplers = [m for m in model.modules() if callable(getattr(m, "_set_2d_pos_cache", None))]
    for resampler in resamplers:
        resampler._set_2d_pos_cache(resampler.max_size, device="cpu")
    if hasattr(model, "resampler") and not resamplers:
        raise AttributeError("the resampler has no _set_2d_pos_cache to rebuild its position table with")
    return len(resamplers)


def load_minicpmo_parts(path: Path, *, dtype, attn_implementation: str, device, step: Callable[[], None]):
    """The processor (with its tokenizer) and the vision+language part of the model, on `device`."""
    from transformers import AutoConfig, AutoProcessor
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    with remote_code_compat():
        try:
            processor = AutoProcessor.from_pretrained(path, trust_remote_code=True)
            step()
            config = AutoConfig.from_pretrained(path, trust_remote_code=True)
            model_class = _with_post_init(get_class_from_dynamic_module(config.auto_map["AutoModel"], path))
            model = model_class.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation,
                                                init_vision=True, init_audio=False, init_tts=False,
                                                device_map=str(device) if device.type == "cuda" else None)  # ~19 GB
            restore_position_tables(model)
        except (ImportError, AttributeError, TypeError, NameError, KeyError) as exc:   # code for another transformers
            raise _remote_code_error(path, exc) from None
    step()
    model = model.to(device).eval()
    model.processor = processor          # chat() would otherwise load it again from config._name_or_path
    step()
    return model, processor


def _remote_code_error(path: Path, exc: Exception):
    import transformers

    from inference_worker.engines.hf.loading import ModelLoadError
    what = " ".join(f"{type(exc).__name__}: {exc}".split())
    return ModelLoadError(
        f"MiniCPM-o's own model code in {path} does not load under transformers {transformers.__version__} even "
        f"with DeskEye's compatibility layer ({what}); use the official openbmb/MiniCPM-o-4_5 revision, or "
        "openbmb/MiniCPM-V-4.6, which transformers supports natively.")
