#!/usr/bin/env bash
# The whole test suite, from a fresh machine: system packages, a pinned CPU environment, pytest.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k router`).
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
source "$(dirname "${BASH_SOURCE[0]}")/_vllm_env.sh"
deskeye_apt xvfb xauth xdotool x11-utils xcompmgr imagemagick fonts-noto-cjk fonts-dejavu-core \
    tk8.6 libtk8.6 dovecot-imapd dbus-daemon libnotify-bin iproute2 util-linux
# The test desktop: a window manager, a notification daemon, two XEmbed tray hosts, an SNI host, xclock.
deskeye_apt openbox dunst trayer tint2 xfce4-panel x11-apps
# The tray icon (GTK 3 + Ayatana AppIndicator typelibs) and what pip needs to build PyGObject against them.
deskeye_apt $DESKEYE_TRAY_APT
# Real programs the OCR tests render their screens with (a terminal, dialogs, a spreadsheet).
deskeye_apt xterm zenity gnumeric
# torch is pinned to the CPU build: never let pip pick a CUDA one for the tests.
deskeye_env "worker,dev,tray" "torch==2.13.0"
deskeye_vllm_env     # vLLM's own venv for tests/test_vllm*.py (DESKEYE_SKIP_VLLM=1 skips it)
cd "$ROOT"
exec "$VENV/bin/python" -m pytest "$@"
