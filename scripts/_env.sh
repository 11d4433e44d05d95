# Sourced by run.sh and test.sh: make .venv/ hold DeskEye and what the given extras need.
# Re-installs only when pyproject.toml, the extras or deskeye_env itself change.
# Usage: deskeye_env "extras" [pip args...]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"

deskeye_env() {
    local extras="$1"; shift
    local stamp="$VENV/.deskeye-installed"
    local want
    want="$({ cat "$ROOT/pyproject.toml"; declare -f deskeye_env; } | sha256sum | cut -c1-16) $extras $*"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return 0; fi
    echo "deskeye: setting up $VENV (extras: ${extras:-none}) ..." >&2
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
    if [ "$#" -gt 0 ]; then "$VENV/bin/python" -m pip install -q "$@"; fi
    local target="$ROOT"
    [ -n "$extras" ] && target="$ROOT[$extras]"
    PYTHONWARNINGS=ignore "$VENV/bin/python" -m pip install -q -e "$target"   # quiet setuptools notices
    echo "$want" > "$stamp"
}

# The tray's system packages: GTK 3 and Ayatana AppIndicator typelibs at run time, and the headers pip
# builds PyGObject (the [tray] extra) against. PyGObject < 3.51 uses girepository-1.0, which Debian 12 has.
DESKEYE_TRAY_APT="gir1.2-gtk-3.0 gir1.2-ayatanaappindicator3-0.1 libgirepository1.0-dev libcairo2-dev pkg-config gcc python3-dev"
# Seeing the screen in a Wayland session: the xdg-desktop-portal ScreenCast stream is a PipeWire stream, read with
# GStreamer through PyGObject (the tray's). The portal and the desktop's backend come with GNOME and KDE Plasma;
# sway needs xdg-desktop-portal-wlr, whose Screenshot runs grim.
DESKEYE_WAYLAND_APT="gir1.2-gstreamer-1.0 gir1.2-gst-plugins-base-1.0 gstreamer1.0-plugins-base gstreamer1.0-pipewire"

# System packages the desktop app needs (X display tools, Tk, fonts). Installs only what is missing: one dpkg-query
# for all of them, and a package removed but not purged (only its configuration files left) counts as missing.
deskeye_apt() {
    local installed missing=()
    installed=" $(dpkg-query -W -f='${db:Status-Status}:${Package} ' "$@" 2>/dev/null || true) "
    for pkg in "$@"; do [[ "$installed" == *" installed:$pkg "* ]] || missing+=("$pkg"); done
    [ "${#missing[@]}" -eq 0 ] && return 0
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    echo "deskeye: installing system packages: ${missing[*]}" >&2
    $sudo apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
}
