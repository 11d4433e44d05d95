#!/usr/bin/env bash
# Export a Hugging Face vision-language model to OpenVINO IR with INT8 weights, for `deskeye-worker --engine openvino`.
#
#   bash scripts/export_openvino.sh MODEL_DIR_OR_ID OUT_DIR [--weight-format int8|int4|fp16|fp32]
#
# The exporter (optimum-intel) needs older transformers than the worker, so it runs in its own environment,
# created once in the repository (.venv-openvino-export/, gitignored) and re-created only when the pins below change.
# DESKEYE_OPENVINO_EXPORT_VENV moves that environment elsewhere.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DESKEYE_OPENVINO_EXPORT_VENV:-$ROOT/.venv-openvino-export}"
PY="${PYTHON:-python3}"
PINS=("optimum-intel==2.2.0" "transformers==5.5.4" "huggingface-hub<1.22" "torch==2.13.0" "nncf==3.4.0"
      "openvino==2026.4.1" "openvino-tokenizers==2026.4.1.0")

usage() {
    echo "usage: bash scripts/export_openvino.sh MODEL_DIR_OR_ID OUT_DIR [--weight-format int8|int4|fp16|fp32]" >&2
    exit 2
}
[ "$#" -ge 2 ] || usage
MODEL="$1"; OUT="$2"; shift 2
WEIGHTS="int8"
while [ "$#" -gt 0 ]; do
    case "$1" in
        --weight-format) [ "$#" -ge 2 ] || usage; WEIGHTS="$2"; shift 2 ;;
        *) echo "export_openvino: unknown option $1" >&2; usage ;;
    esac
done

make_env() {
    local stamp="$VENV/.deskeye-export-installed" want
    want="$(printf '%s\n' "${PINS[@]}" | sha256sum | cut -c1-16)"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return 0; fi
    echo "export_openvino: [1/3] creating the export environment in $VENV (once; a few minutes) ..." >&2
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
    "$VENV/bin/python" -m pip install --progress-bar on "${PINS[@]}" >&2
    # optimum-intel pulls torchvision, whose only wheel for torch 2.13 is CUDA-linked and breaks transformers'
    # processors at import (see the field notes): the export does not need it.
    "$VENV/bin/python" -m pip uninstall -q -y torchvision >/dev/null 2>&1 || true
    echo "$want" > "$stamp"
}

make_env
echo "export_openvino: [1/3] export environment ready ($VENV)" >&2
exec "$VENV/bin/python" "$ROOT/inference_worker/engines/openvino/export.py" "$MODEL" "$OUT" --weight-format "$WEIGHTS"
