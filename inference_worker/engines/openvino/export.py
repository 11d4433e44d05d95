"""Export a Hugging Face vision-language model to OpenVINO IR (run by scripts/export_openvino.sh).

This file runs inside the export environment (optimum-intel + an older transformers), not the worker's: it imports
nothing from DeskEye and only the standard library at import time. Steps: check the architecture is one
optimum-intel exports for image-text-to-text (a clear one-line error otherwise), run `optimum-cli export openvino`
with the requested weight format (its progress shown as it comes), then check the IR files the worker needs exist.

Exit status: 0 exported, 2 bad arguments, 3 unsupported architecture, 1 the exporter failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

PROG = "export_openvino"
TASK = "image-text-to-text"
WEIGHT_FORMATS = ("int8", "int4", "fp16", "fp32")
#: the IR files every exported vision-language model has (the worker's engine checks the same names)
REQUIRED_IR = ("openvino_language_model.xml", "openvino_text_embeddings_model.xml",
               "openvino_vision_embeddings_model.xml")
#: model types known not to export (for a message that says why, rather than the exporter's traceback)
KNOWN_UNSUPPORTED = {
    "minicpmv4_6": "MiniCPM-V 4.6 is supported neither by optimum-intel 2.2 nor by openvino-genai; on a CPU serve it "
                   "with the transformers engine (--engine transformers --device cpu)",
    "minicpmv4_7": "MiniCPM-V 4.7 is not supported by optimum-intel 2.2; serve it with the transformers engine",
}


class ExportError(Exception):
    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        export(args.model, Path(args.out), args.weight_format)
    except ExportError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return exc.status
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Export a vision-language model to OpenVINO IR.")
    p.add_argument("model", help="a local model folder or a Hugging Face id")
    p.add_argument("out", help="the folder to write the IR model to")
    p.add_argument("--weight-format", choices=WEIGHT_FORMATS, default="int8")
    return p


def export(model: str, out: Path, weight_format: str) -> None:
    model_type = check_architecture(model)
    _say(f"[2/3] exporting {model} ({model_type}) with {weight_format} weights to {out} ...")
    _run_exporter(model, out, weight_format)
    missing = [name for name in REQUIRED_IR if not (out / name).is_file()]
    if missing:
        raise ExportError(f"the exporter finished but {out} lacks {', '.join(missing)}; is {model} a "
                          f"vision-language model?")
    size_mb = sum(f.stat().st_size for f in out.glob("openvino_*.bin")) / 2**20
    _say(f"[3/3] done: {out} ({size_mb:.1f} MB of IR weights). Serve it with: "
         f"deskeye-worker --engine openvino --model {out}")


def check_architecture(model: str) -> str:
    """The model's model_type, once it is known to export for image-text-to-text; ExportError(3) otherwise."""
    config = _read_config(model)
    model_type = str(config.get("model_type", ""))
    if not model_type:
        raise ExportError(f"{model}/config.json has no model_type: not a Hugging Face model folder.", 3)
    if model_type in KNOWN_UNSUPPORTED:
        raise ExportError(f"cannot export {model}: {KNOWN_UNSUPPORTED[model_type]}.", 3)
    supported = supported_model_types()
    if model_type.replace("_", "-") not in supported:
        raise ExportError(f"cannot export {model}: architecture {model_type!r} is not one optimum-intel exports "
                          f"for {TASK} (supported: {', '.join(sorted(supported))}).", 3)
    return model_type


def supported_model_types() -> set[str]:
    """Model types (dashed) that optimum-intel's OpenVINO exporter knows for image-text-to-text."""
    from optimum.exporters.tasks import TasksManager
    import optimum.exporters.openvino.model_configs  # noqa: F401 - registers the OpenVINO export configs

    table = TasksManager._SUPPORTED_MODEL_TYPE
    return {name for name, exporters in table.items() if TASK in exporters.get("openvino", {})}


def _read_config(model: str) -> dict:
    path = Path(model).expanduser()
    if not path.exists():
        if model.startswith((".", "/", "~")) or model.count("/") != 1:
            raise ExportError(f"{model}: no such folder (and not a Hugging Face id like org/name).", 2)
        path = _download(model)
    config = path / "config.json"
    try:
        return json.loads(config.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ExportError(f"{path} has no config.json: give a Hugging Face model folder.", 3) from None
    except ValueError as exc:
        raise ExportError(f"{config} is not valid JSON ({exc}).", 3) from None


def _download(repo_id: str) -> Path:
    _say(f"[1/3] fetching {repo_id} from the Hugging Face hub ...")
    from huggingface_hub import snapshot_download
    try:
        return Path(snapshot_download(repo_id))
    except Exception as exc:  # noqa: BLE001 - offline, private, misspelt: one line
        raise ExportError(f"cannot fetch {repo_id} ({type(exc).__name__}: {' '.join(str(exc).split())[:300]}); "
                          f"download it first and give its folder.", 2) from None


def _run_exporter(model: str, out: Path, weight_format: str) -> None:
    cli = Path(sys.executable).with_name("optimum-cli")
    command = [str(cli), "export", "openvino", "--model", model, "--task", TASK,
               "--weight-format", weight_format, str(out)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                            errors="replace")
    tail: list[str] = []
    for line in proc.stdout:                      # the exporter's own progress, passed on as it comes
        sys.stderr.write(line)
        tail = (tail + [line.strip()])[-20:]
    if proc.wait() != 0:
        last = next((line for line in reversed(tail) if line), "no output")
        raise ExportError(f"optimum-cli export failed (exit {proc.returncode}): {last}")


def _say(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
