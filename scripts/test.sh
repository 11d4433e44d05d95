#!/usr/bin/env bash
# The whole test suite, from a fresh machine: system packages, a pinned CPU environment, pytest.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k router`).
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
source "$(dirname "${BASH_SOURCE[0]}")/_vllm_env.sh"
deskeye_apt xvfb xauth xdotool x11-utils xcompmgr imagemagick fonts-noto-cjk fonts-dejavu-core \
    tk8.6 libtk8.6 dovecot-imapd dbus-daemon libnotify-bin iproute2 util-linux
# torch is pinned to the CPU build: never let pip pick a CUDA one for the tests.
deskeye_env "worker,dev" "torch==2.13.0"
deskeye_vllm_env     # vLLM's own venv for tests/test_vllm*.py (DESKEYE_SKIP_VLLM=1 skips it)
cd "$ROOT"
exec "$VENV/bin/python" -m pytest "$@"
