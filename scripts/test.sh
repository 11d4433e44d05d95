#!/usr/bin/env bash
# The whole test suite, from a fresh machine: system packages, a pinned CPU environment, pytest.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k router`).
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
source "$(dirname "${BASH_SOURCE[0]}")/_vllm_env.sh"
# On a fresh machine the setup takes minutes; the parts that do not need each other run side by side. vLLM's own
# venv (tests/test_vllm*.py; DESKEYE_SKIP_VLLM=1 skips it) needs no system package: it installs from the start.
deskeye_vllm_env & vllm_env=$!
# The tray icon (GTK 3 + Ayatana AppIndicator typelibs) and what pip needs to build PyGObject against them: first,
# so DeskEye's venv (torch pinned to the CPU build: never let pip pick a CUDA one) installs while apt works on.
deskeye_apt $DESKEYE_TRAY_APT
deskeye_env "worker,dev,tray" "torch==2.13.0" & deskeye_venv=$!
packages=(
    # X servers and tools, Tk, fonts (Chinese too), a mail server, D-Bus, notifications, namespaces.
    xvfb xauth xdotool x11-utils xcompmgr imagemagick fonts-noto-cjk fonts-dejavu-core tk8.6 libtk8.6 dovecot-imapd
    dbus-daemon libnotify-bin iproute2 util-linux
    # The test desktop: a window manager, a notification daemon, two XEmbed tray hosts, an SNI host, xclock,
    # xrandr and xrdb (monitors and DPI).
    openbox dunst trayer tint2 xfce4-panel x11-apps x11-xserver-utils
    # Real programs the OCR tests render their screens with (a terminal, dialogs, a spreadsheet, an editor), and the
    # locale sources the Chinese ones build a private zh_CN.UTF-8 from.
    xterm zenity gnumeric mousepad locales
    # A headless Wayland desktop (weston with Xwayland): DeskEye must say it cannot capture there, not describe black.
    weston xwayland
    # A headless GNOME Wayland desktop where DeskEye sees the screen through xdg-desktop-portal: gnome-shell,
    # PipeWire, the GNOME portal, and GStreamer's PipeWire source with its typelibs (tests/fixtures/gnome.py).
    gnome-shell xdg-desktop-portal xdg-desktop-portal-gnome pipewire wireplumber $DESKEYE_WAYLAND_APT
    # A headless sway (tests/fixtures/sway.py): its IPC tells every window, native ones too, so privacy works on
    # Wayland; with the wlr portal (its Screenshot runs grim) DeskEye sees the screen there too.
    sway xdg-desktop-portal-wlr xdg-desktop-portal-gtk grim libglib2.0-bin
    # A headless KDE Plasma (tests/fixtures/kde.py): kwin with its portal, whose GlobalShortcuts carry DeskEye's keys
    # into native Wayland windows; Qt's Wayland platform, and Plasma's QML the portal's Screenshot needs.
    kwin-wayland xdg-desktop-portal-kde qtwayland5 plasma-workspace qml-module-org-kde-kirigami2
    # Answers read aloud: the speech engines, a PulseAudio null sink the tests record from, sox to measure it.
    speech-dispatcher speech-dispatcher-espeak-ng espeak-ng sox pulseaudio pulseaudio-utils
)
deskeye_apt "${packages[@]}"
wait "$deskeye_venv" || { echo "deskeye: setting up $VENV failed (its output is above)" >&2; exit 1; }
wait "$vllm_env" || { echo "deskeye: setting up $VLLM_VENV failed (its output is above)" >&2; exit 1; }
cd "$ROOT"
# Test files run side by side in DESKEYE_TEST_PROCESSES processes (default 3: on 2 cores most tests wait on X
# servers, subprocesses and HTTP, not on the CPU); `-n 0` after the command runs them in this one process.
exec "$VENV/bin/python" -m pytest -n "${DESKEYE_TEST_PROCESSES:-3}" --dist loadfile --no-loadscope-reorder "$@"
