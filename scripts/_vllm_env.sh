# Sourced by test.sh: .venv-vllm/ holds vLLM's CPU build for the external-engine tests (tests/test_vllm*.py).
# Re-installs only when scripts/vllm-requirements.txt or this file change. Set DESKEYE_SKIP_VLLM=1 to skip it
# (the vLLM tests then skip and say why).
VLLM_VENV="$ROOT/.venv-vllm"

deskeye_vllm_env() {
    [ "${DESKEYE_SKIP_VLLM:-0}" = "1" ] && return 0
    local stamp="$VLLM_VENV/.deskeye-installed"
    local want
    want="$(cat "$ROOT/scripts/vllm-requirements.txt" "$ROOT/scripts/_vllm_env.sh" | sha256sum | cut -c1-16)"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return 0; fi
    echo "deskeye: setting up $VLLM_VENV (vLLM CPU build, ~3.5 GB, a few minutes) ..." >&2
    rm -rf "$VLLM_VENV"
    "$PY" -m venv "$VLLM_VENV"
    "$VLLM_VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
    "$VLLM_VENV/bin/python" -m pip install -q -r "$ROOT/scripts/vllm-requirements.txt"
    # PyPI's torchvision/torchaudio/torchcodec for it are CUDA-linked and fail to import beside the CPU torch;
    # present but broken, transformers' metadata check makes every processor use them. Remove them.
    "$VLLM_VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    "$VLLM_VENV/bin/python" -c "import vllm, xgrammar, llguidance, outlines_core" \
        || { echo "deskeye: $VLLM_VENV does not import vllm and its grammar backends" >&2; return 1; }
    echo "$want" > "$stamp"
}
