"""A model's files: a local folder or a Hub id resolved to a folder (downloaded when online), checked to be complete
before anything loads, and its weights' size read from the safetensors headers (for the memory check and the CPU
dtype choice). Every problem a user can fix is a `ModelLoadError` that says what is wrong and what to do.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "model*.bin")
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
_TRUE = {"1", "on", "yes", "true"}


class ModelLoadError(Exception):
    """The model cannot be loaded; the message says why and what to do about it."""


# ---------------------------------------------------------------- where the files are

def resolve_model_path(model: str, *, progress: bool = True) -> Path:
    """A local folder as is; a Hub id from the local HF cache, downloading it when online."""
    local = Path(model).expanduser()
    if local.exists():
        if not local.is_dir():
            raise ModelLoadError(f"Model path {local} is a file; pass the folder that holds config.json.")
        return local.resolve()
    if not _HUB_ID.match(model) or model.startswith((".", "~")):
        raise ModelLoadError(f"Model folder {local} does not exist. Check the path, or pass a Hugging Face "
                             "Hub id such as openbmb/MiniCPM-V-4.6.")
    return _snapshot(model, progress=progress)


def is_offline() -> bool:
    return any(os.environ.get(k, "").strip().lower() in _TRUE for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _snapshot(repo_id: str, *, progress: bool) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    offline = is_offline()
    how_to_get = (f"Download it first on a machine with internet access: `hf download {repo_id}` "
                  f"(or `huggingface-cli download {repo_id}`), then copy the folder and pass its path, "
                  "or copy the Hugging Face cache (~/.cache/huggingface/hub).")
    try:
        kwargs = {} if progress else {"tqdm_class": _quiet_tqdm_class()}
        return Path(snapshot_download(repo_id, local_files_only=offline, **kwargs))
    except GatedRepoError:
        raise ModelLoadError(f"{repo_id} is gated on the Hub: accept its licence on its model page and log in "
                             "with `hf auth login`, then try again.") from None
    except RepositoryNotFoundError:
        raise ModelLoadError(f"There is no model {repo_id!r} on the Hugging Face Hub (or it is private). "
                             "Check the id, e.g. openbmb/MiniCPM-V-4.6.") from None
    except LocalEntryNotFoundError:
        why = ("HF_HUB_OFFLINE is set" if offline else "the Hub cannot be reached")
        raise ModelLoadError(f"{repo_id} is neither a local folder nor in the local Hugging Face cache, and {why}. "
                             f"{how_to_get} "
                             "If it is cached, set HF_HUB_OFFLINE=1 to skip the network.") from None
    except (HfHubHTTPError, OSError) as exc:
        raise ModelLoadError(f"Could not download {repo_id}: {exc}. {how_to_get}") from None


def _quiet_tqdm_class():
    from tqdm.auto import tqdm

    class QuietTqdm(tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "disable": True})
    return QuietTqdm


# ---------------------------------------------------------------- is the folder complete

def check_model_folder(path: Path) -> dict[str, Any]:
    """Read config.json; raise ModelLoadError listing what the folder lacks."""
    missing = []
    if not (path / CONFIG_FILE).is_file():
        missing.append(f"{CONFIG_FILE} (the model configuration)")
    missing += _missing_weights(path)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        missing.append(f"tokenizer files ({' or '.join(TOKENIZER_FILES)})")
    if not any((path / name).is_file() for name in PROCESSOR_FILES):
        missing.append(f"image processor files ({' or '.join(PROCESSOR_FILES)})")
    missing += _missing_remote_code(path)
    if missing:
        raise ModelLoadError(f"The model folder {path} is incomplete; it lacks: " + "; ".join(missing)
                             + ". Download the whole checkpoint again (e.g. `hf download ID --local-dir "
                               f"{path}`).")
    try:
        return json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path / CONFIG_FILE} cannot be read as JSON ({exc}); download it again.") from None


def _missing_weights(path: Path) -> list[str]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, ValueError, KeyError):
            return [f"a readable {index.name}"]
        absent = sorted(s for s in shards if not (path / s).is_file())
        return [f"weight shards {', '.join(absent)}"] if absent else []
    if any(next(path.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
        return []
    return ["weights (*.safetensors or pytorch_model*.bin)"]


def _missing_remote_code(path: Path) -> list[str]:
    """The modeling files config.json's auto_map names (checkpoints that ship their own code)."""
    try:
        auto_map = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8")).get("auto_map") or {}
    except (OSError, ValueError, AttributeError):
        return []
    refs = [r for v in auto_map.values() for r in (v if isinstance(v, list) else [v]) if isinstance(r, str)]
    modules = {r.split("--")[-1].rsplit(".", 1)[0] + ".py" for r in refs}
    absent = sorted(m for m in modules if not (path / m).is_file())
    return [f"its own model code ({', '.join(absent)})"] if absent else []

# ---------------------------------------------------------------- how big it is

def checkpoint_weight_bytes(path: Path, *, itemsize: int, skip_prefixes: tuple[str, ...] = ()) -> int:
    """Bytes the weights take in memory once floats are cast to `itemsize`; read from safetensors headers.

    Integer tensors (packed 4-bit weights) keep their stored size. Falls back to file sizes for .bin.
    """
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return sum(f.stat().st_size for pattern in WEIGHT_PATTERNS[1:] for f in path.glob(pattern))
    total = 0
    for file in files:
        for name, info in _safetensors_header(file).items():
            if name == "__metadata__" or name.startswith(skip_prefixes):
                continue
            if info["dtype"] in _FLOAT_DTYPES:
                total += math.prod(info["shape"]) * itemsize
            else:
                total += info["data_offsets"][1] - info["data_offsets"][0]
    return total


def _safetensors_header(file: Path) -> dict[str, Any]:
    with file.open("rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        return json.loads(fh.read(length))

def num_checkpoint_params(path: Path) -> int:
    """About how many parameters the checkpoint in `path` holds (its float tensors, from the safetensors headers)."""
    return checkpoint_weight_bytes(path, itemsize=1)
