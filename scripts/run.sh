#!/usr/bin/env bash
# DeskEye's main job: set up (first time only) and start the tray app. Arguments go to `deskeye run`.
# With no model configured it uses the built-in OCR engine: no GPU, no torch, nothing downloaded.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
# The tray icon and its menu need GTK 3 through PyGObject (built by pip against these; as root or with sudo).
# Set DESKEYE_NO_TRAY=1 to skip them: DeskEye then runs without an icon (hotkeys, Ask box, overlay menu).
# In a Wayland session DeskEye sees the screen through xdg-desktop-portal's PipeWire stream, read with GStreamer.
if [ -z "${DESKEYE_NO_TRAY:-}" ] && command -v apt-get >/dev/null; then
    deskeye_apt $DESKEYE_TRAY_APT
    if [ "${XDG_SESSION_TYPE:-}" = wayland ] || [ -n "${WAYLAND_DISPLAY:-}" ]; then
        deskeye_apt $DESKEYE_WAYLAND_APT
    fi
    deskeye_env "tray"
else
    deskeye_env ""
fi
exec "$VENV/bin/deskeye" run "$@"
