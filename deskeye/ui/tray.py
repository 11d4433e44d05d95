"""The tray icon: Describe now, Ask…, Pause/Resume, Open settings, Quit (deskeye/ui/menu.py); it shows the state.

On Linux the icon is GTK 3 through PyGObject, on its own thread (`deskeye-tray`), which runs the GLib main
loop and is the only thread that touches GTK: `set_state` and `stop` post to it with `GLib.idle_add`.
- With a StatusNotifierItem host (KDE, GNOME + AppIndicator extension) it is an Ayatana AppIndicator;
- otherwise an XEmbed icon (`Gtk.StatusIcon`: trayer, tint2, stalonetray, xfce/mate panels). GTK follows
  the tray selection, so the icon docks again by itself when the tray host restarts or another one starts.
Left or right click opens the menu. Without a tray host, or without PyGObject, it says so once and the
app keeps working: the hotkeys, the Ask box and a right-click on the overlay give the same menu.
Elsewhere (macOS, Windows) pystray shows it.
A `stop()` that comes while the icon is still being made is kept: the tray thread then never enters its loop, and
its icon folder is removed either way.
"""

from __future__ import annotations

import enum
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Callable

from PIL import Image, ImageDraw

from deskeye.errors import DeskEyeError
from deskeye.hotkey_syntax import display_name
from deskeye.language import N_, _
from deskeye.lifecycle import reassert_display_handler
from deskeye.ui.menu import MenuActions, menu_entries

log = logging.getLogger(__name__)



class TrayState(enum.StrEnum):
    IDLE = "idle"
    BUSY = "busy"
    PAUSED = "paused"
    WORKER_DOWN = "worker down"


IDLE, BUSY, PAUSED, WORKER_DOWN = TrayState.IDLE, TrayState.BUSY, TrayState.PAUSED, TrayState.WORKER_DOWN
STATE_COLOURS = {IDLE: "#3aa655", BUSY: "#2f7fd8", PAUSED: "#8a8a8a", WORKER_DOWN: "#d64545"}
#: the state as the icon's tooltip names it: "DeskEye (idle)"
STATE_LABELS = {IDLE: N_("idle"), BUSY: N_("busy"), PAUSED: N_("paused"), WORKER_DOWN: N_("worker down")}
ICON_SIZE_PX = 64
STOP_WAIT_S = 5.0
CANCEL_POLL_S = 0.05             # how often start() checks whether the app quit meanwhile
TrayActions = MenuActions          # what the menu does (deskeye/ui/menu.py)
NO_GTK_MESSAGE = ("The tray icon needs PyGObject with GTK 3 ({error}); scripts/run.sh installs both. Meanwhile "
                  "use the hotkeys ({ask} opens the Ask box) or right-click the overlay for the menu.")
NO_HOST_MESSAGE = ("No system tray is running (no XEmbed tray owns _NET_SYSTEM_TRAY_S0 and no "
                   "StatusNotifierWatcher is on the session bus): the DeskEye icon appears as soon as a panel "
                   "with a tray starts. Meanwhile use the hotkeys ({ask} opens the Ask box) or right-click the "
                   "overlay for the menu.")


def draw_icon(state: str, size_px: int = ICON_SIZE_PX) -> Image.Image:
    """An eye on a disc coloured by state; paused adds two bars, worker down a cross."""
    image = Image.new("RGBA", (size_px, size_px), (0, 0, 0, 0))
    draw = ImageDraw.Draw(image)
    s = size_px
    draw.ellipse((1, 1, s - 2, s - 2), fill=STATE_COLOURS.get(state, STATE_COLOURS[IDLE]))
    draw.ellipse((s * 0.15, s * 0.32, s * 0.85, s * 0.68), fill="white")
    draw.ellipse((s * 0.38, s * 0.36, s * 0.62, s * 0.64), fill="#1f2430")
    if state == PAUSED:
        draw.rectangle((s * 0.36, s * 0.30, s * 0.44, s * 0.70), fill="#f0f0f0")
        draw.rectangle((s * 0.56, s * 0.30, s * 0.64, s * 0.70), fill="#f0f0f0")
    elif state == WORKER_DOWN:
        draw.line((s * 0.25, s * 0.25, s * 0.75, s * 0.75), fill="white", width=max(s // 10, 2))
        draw.line((s * 0.75, s * 0.25, s * 0.25, s * 0.75), fill="white", width=max(s // 10, 2))
    return image


class Tray:
    """The icon and its menu, owned by one thread. `start`, `set_state` and `stop` may be called from any thread."""

    def __init__(self, actions: MenuActions, *, ask_hotkey: str = "<ctrl>+<alt>+a", temp_root: Path | None = None):
        self.actions = actions
        self.ask_hotkey = ask_hotkey
        self.temp_root = temp_root           # where the icon folder goes (None: the system temp folder)
        self.state = IDLE
        self.backend = ""                    # "appindicator" | "statusicon" | "pystray" | "none", once started
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._lock = threading.Lock()
        self._stopping = False               # stop() was called: never enter (or leave at once) the loop
        self._glib = None                    # the GLib module, set by the tray thread once its loop can run
        self._gtk: dict = {}                 # GTK objects: touched only by the tray thread
        self._pystray_icon = None

    def start(self, timeout_s: float = 10.0, *, cancel: threading.Event | None = None) -> None:
        """Start the tray thread; wait until the icon exists, at most `timeout_s`, and no longer once `cancel` is
        set (the app quit meanwhile)."""
        self._thread = threading.Thread(target=self._run, name="deskeye-tray", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._started.wait(CANCEL_POLL_S):
            if (cancel is not None and cancel.is_set()) or time.monotonic() >= deadline:
                return

    def set_state(self, state: TrayState) -> None:
        with self._lock:
            self.state = TrayState(state)
            glib = self._glib
        if glib is not None:
            glib.idle_add(self._apply_state)

    def stop(self, timeout_s: float = STOP_WAIT_S) -> None:
        with self._lock:
            self._stopping = True
            glib, self._glib = self._glib, None
        if glib is not None:
            glib.idle_add(self._quit_loop)
        elif self._pystray_icon is not None:
            threading.Thread(target=self._pystray_icon.stop, name="deskeye-tray-stop", daemon=True).start()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def title(self) -> str:
        return f"DeskEye ({_(STATE_LABELS[self.state])})"

    # ------------------------------------------------------------ the tray thread

    def _run(self) -> None:
        try:
            if sys.platform.startswith("linux"):
                self._run_gtk()
            else:
                self._run_pystray()
        except Exception:
            log.exception("The tray icon stopped; the hotkeys and the overlay keep working")
        finally:
            self._started.set()

    def _run_gtk(self) -> None:
        from deskeye.ui.tray_host import TrayHost, find_tray_host
        try:
            gtk, glib = _import_gtk()
        except (ImportError, ValueError) as exc:          # no PyGObject, or no GTK 3 typelib
            self.backend = "none"
            log.warning(NO_GTK_MESSAGE.format(error=exc, ask=display_name(self.ask_hotkey)))
            return
        reassert_display_handler()           # GTK's own ends the process without any cleanup
        host = find_tray_host()
        if host is TrayHost.NONE:
            log.warning(NO_HOST_MESSAGE.format(ask=display_name(self.ask_hotkey)))
        icon_dir = Path(tempfile.mkdtemp(prefix="deskeye-tray-", dir=self.temp_root))
        try:
            self._gtk = {"Gtk": gtk, "icon_dir": icon_dir}
            if host is TrayHost.SNI and self._make_indicator():
                self.backend = "appindicator"
            else:
                self._make_status_icon()
                self.backend = "statusicon"
            self._apply_state()
            with self._lock:
                stopping = self._stopping
                if not stopping:
                    self._glib = glib
            self._started.set()
            if stopping:                      # stop() came while the icon was being made
                self._hide()
                return
            gtk.main()
        finally:
            shutil.rmtree(icon_dir, ignore_errors=True)
            self._gtk.clear()

    def _make_status_icon(self) -> None:
        gtk = self._gtk["Gtk"]
        icon = gtk.StatusIcon()
        icon.connect("activate", lambda _icon: self._popup_menu(0))
        icon.connect("popup-menu", lambda _icon, button, _time: self._popup_menu(button))
        icon.connect("notify::embedded", lambda _icon, _spec: log.info(
            "tray icon %s", "docked in the system tray" if icon.is_embedded() else "not docked"))
        self._gtk["status_icon"] = icon

    def _make_indicator(self) -> bool:
        try:
            import gi
            gi.require_version("AyatanaAppIndicator3", "0.1")
            from gi.repository import AyatanaAppIndicator3 as indicator_lib
        except (ImportError, ValueError) as exc:
            log.info("no Ayatana AppIndicator (%s): using an XEmbed tray icon", exc)
            return False
        indicator = indicator_lib.Indicator.new("deskeye", "", indicator_lib.IndicatorCategory.APPLICATION_STATUS)
        indicator.set_status(indicator_lib.IndicatorStatus.ACTIVE)
        self._gtk["indicator"] = indicator
        return True

    def _apply_state(self) -> bool:
        """On the tray thread: the icon, tooltip and (for the AppIndicator) menu for the current state."""
        gtk = self._gtk
        if not gtk:
            return False
        path = gtk["icon_dir"] / f"{self.state.name.lower()}.png"
        if not path.exists():
            draw_icon(self.state).save(path)
        if "status_icon" in gtk:
            gtk["status_icon"].set_from_file(str(path))
            gtk["status_icon"].set_tooltip_text(self.title())
            gtk["status_icon"].set_title(self.title())
        else:
            gtk["indicator"].set_icon_full(str(path), self.title())
            gtk["indicator"].set_title(self.title())
            gtk["indicator"].set_menu(self._build_menu())
        return False                          # run once

    def _build_menu(self):
        gtk = self._gtk["Gtk"]
        menu = gtk.Menu()
        for entry in menu_entries(self.actions):
            item = gtk.MenuItem(label=entry.label)
            item.connect("activate", lambda _item, action=entry.action: _call(action))
            menu.append(item)
        menu.show_all()
        self._gtk["menu"] = menu              # kept alive while shown
        return menu

    def _popup_menu(self, button: int) -> None:
        gtk = self._gtk["Gtk"]
        menu = self._build_menu()
        menu.popup(None, None, gtk.StatusIcon.position_menu, self._gtk["status_icon"], button,
                   gtk.get_current_event_time())

    def _quit_loop(self) -> bool:
        self._hide()
        self._gtk["Gtk"].main_quit()
        return False

    def _hide(self) -> None:
        gtk = self._gtk
        if "status_icon" in gtk:
            gtk["status_icon"].set_visible(False)
        if "menu" in gtk:
            gtk["menu"].destroy()

    def _run_pystray(self) -> None:
        import pystray
        items = [pystray.MenuItem(e.label, lambda _icon, _item, a=e.action: _call(a)) for e in
                 menu_entries(self.actions)]
        icon = pystray.Icon("deskeye", draw_icon(self.state), self.title(), menu=pystray.Menu(*items))
        with self._lock:
            stopping = self._stopping
            self._pystray_icon = None if stopping else icon
        self.backend = "pystray"
        self._started.set()
        if not stopping:
            icon.run()


def _import_gtk():
    import gi
    gi.require_version("Gtk", "3.0")
    from gi.repository import GLib, Gtk
    # Gtk.StatusIcon is deprecated in GTK 3 yet it is what XEmbed trays (trayer, tint2, ...) understand.
    warnings.filterwarnings("ignore", message=r"Gtk\.StatusIcon\.", category=DeprecationWarning)
    return Gtk, GLib


def _call(action: Callable[[], None]) -> None:
    try:
        action()
    except Exception:                 # a menu action must not end the tray's loop
        log.exception("menu action failed")


def opener_argv(path: Path) -> list[str]:
    """The platform's "open this file" command as an argv list (never through a shell)."""
    if sys.platform == "darwin":
        return ["open", str(path)]
    return ["xdg-open", str(path)]


def open_settings_file(path: Path, *, init_file: Callable[[Path], bool] | None = None) -> list[str] | None:
    """Create the documented settings file if missing, then open it in the user's editor.

    Returns the argv that was started (None on Windows, where os.startfile is used).
    """
    if init_file is None:
        from deskeye.settings_cli import init_settings_file as init_file
    init_file(path)
    if sys.platform == "win32":
        os.startfile(str(path))  # noqa: S606 - the documented way to open a file on Windows
        return None
    argv = opener_argv(path)
    program = shutil.which(argv[0])
    if program is None:
        raise DeskEyeError(f"Cannot open {path}: {argv[0]} is not installed. Edit the file with any text editor.")
    proc = subprocess.Popen([program, *argv[1:]], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    threading.Thread(target=proc.wait, name="deskeye-opener-reaper", daemon=True).start()
    return argv
