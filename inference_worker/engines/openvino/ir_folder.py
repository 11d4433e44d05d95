"""What an OpenVINO IR folder (as optimum-intel exports a vision-language model) must hold, and how it is recognised.

`is_ir_folder` is the cheap check `--engine auto` uses (the language model's .xml is there; `deskeye doctor` makes
its own file check, the app never imports the worker);
`check_ir_folder` is the full one the engine runs before compiling: every .xml with its .bin, a config.json of a
family this engine drives, a tokenizer. Every failure is an `IRFolderError`, one line naming the file and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LANGUAGE_MODEL = "openvino_language_model"
TEXT_EMBEDDINGS = "openvino_text_embeddings_model"
VISION_EMBEDDINGS = "openvino_vision_embeddings_model"
IR_MODELS = (LANGUAGE_MODEL, TEXT_EMBEDDINGS, VISION_EMBEDDINGS)
#: model_types whose exported parts this engine knows how to join: the vision model's features replace the
#: prompt's image tokens one for one (LLaVA). Others (MiniCPM-o's resampler and slices, Qwen2-VL's grid positions)
#: need their own merge step.
SUPPORTED_MODEL_TYPES = ("llava",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
EXPORT_HINT = "bash scripts/export_openvino.sh MODEL_DIR_OR_ID OUT_DIR"


class IRFolderError(Exception):
    """The folder cannot be served by the OpenVINO engine; the message names what is wrong and the fix."""


def is_ir_folder(path: str | Path) -> bool:
    """Whether `path` is a folder holding an exported OpenVINO language model (its .xml)."""
    folder = Path(path).expanduser()
    return folder.is_dir() and (folder / f"{LANGUAGE_MODEL}.xml").is_file()


def check_ir_folder(path: str | Path) -> dict[str, Any]:
    """The folder's config.json, once every IR file and a tokenizer are present and its family is supported."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise IRFolderError(f"{folder} is not a folder: give the OpenVINO IR folder made by {EXPORT_HINT}.")
    if not any(folder.glob("openvino_*.xml")):
        raise IRFolderError(f"{folder} is not an OpenVINO IR folder (no openvino_*.xml); export it first with "
                            f"{EXPORT_HINT}, or serve it with --engine transformers.")
    config = _read_config(folder)
    model_type = config.get("model_type", "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise IRFolderError(f"{folder} holds a {model_type or 'model without model_type'!r} IR model; the OpenVINO "
                            f"engine drives {', '.join(SUPPORTED_MODEL_TYPES)} models only.")
    missing = [name for part in IR_MODELS for name in (f"{part}.xml", f"{part}.bin") if not (folder / name).is_file()]
    if missing:
        raise IRFolderError(f"{folder} is missing {', '.join(missing)}: the export is incomplete; export it again "
                            f"with {EXPORT_HINT}.")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise IRFolderError(f"{folder} has no tokenizer (tokenizer.json): export it again with {EXPORT_HINT}.")
    return config


def _read_config(folder: Path) -> dict[str, Any]:
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise IRFolderError(f"{folder} has no config.json: export it again with {EXPORT_HINT}.") from None
    except (OSError, ValueError) as exc:
        raise IRFolderError(f"{folder}/config.json cannot be read ({exc}); export it again.") from None
    if not isinstance(config, dict):
        raise IRFolderError(f"{folder}/config.json is not a JSON object; export it again.")
    return config
