#!/usr/bin/env bash
# DeskEye's main job: set up (first time only) and start the tray app. Arguments go to `deskeye run`.
# With no model configured it uses the built-in OCR engine: no GPU, no torch, nothing downloaded.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
deskeye_env ""
exec "$VENV/bin/deskeye" run "$@"
