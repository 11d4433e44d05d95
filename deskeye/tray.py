"""The tray icon (pystray): Describe now, Ask…, Pause/Resume, Open settings, Quit; the icon shows the state.

pystray runs its own loop, so the icon lives on a daemon thread and its `stop()` is best-effort (on the
plain X backend it is unreliable and there is no menu at all). The menu only calls the plain
functions of `TrayActions`, which is what tests call directly.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from PIL import Image, ImageDraw

from deskeye.errors import DeskEyeError

log = logging.getLogger(__name__)

IDLE, BUSY, PAUSED, WORKER_DOWN = "idle", "busy", "paused", "worker down"
STATE_COLOURS = {IDLE: "#3aa655", BUSY: "#2f7fd8", PAUSED: "#8a8a8a", WORKER_DOWN: "#d64545"}
ICON_SIZE_PX = 64
STOP_WAIT_S = 1.0


def _noop() -> None:
    pass


@dataclass
class TrayActions:
    """What the menu does. Each is a plain function that returns at once (it only enqueues work)."""
    describe_now: Callable[[], None] = _noop
    ask: Callable[[], None] = _noop
    toggle_pause: Callable[[], None] = _noop
    open_settings: Callable[[], None] = _noop
    quit: Callable[[], None] = _noop
    is_paused: Callable[[], bool] = lambda: False


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


class _NoSystemTrayFilter(logging.Filter):
    """Without a system tray (no panel, plain X), pystray logs "Failed to dock icon" with a traceback on
    every icon update. Say it once, plainly, instead; the hotkeys and the overlay work without a tray."""

    def __init__(self):
        super().__init__()
        self.has_warned = False

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage() != "Failed to dock icon":
            return True
        if not self.has_warned:
            self.has_warned = True
            log.warning("No system tray found: the DeskEye icon is not shown. The hotkeys work; "
                        "start a panel with a system tray to get the menu.")
        return False


_NO_TRAY_FILTER = _NoSystemTrayFilter()


class Tray:
    def __init__(self, actions: TrayActions):
        self.actions = actions
        self.state = IDLE
        self._icon = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        import pystray
        logging.getLogger("pystray._base").addFilter(_NO_TRAY_FILTER)     # adding it twice is a no-op
        menu = pystray.Menu(
            pystray.MenuItem("Describe now", lambda: self.actions.describe_now(), default=True),
            pystray.MenuItem("Ask…", lambda: self.actions.ask()),
            pystray.MenuItem(lambda item: "Resume" if self.actions.is_paused() else "Pause",
                             lambda: self.actions.toggle_pause()),
            pystray.MenuItem("Open settings", lambda: self.actions.open_settings()),
            pystray.MenuItem("Quit", lambda: self.actions.quit()),
        )
        self._icon = pystray.Icon("deskeye", draw_icon(self.state), self._title(), menu=menu)
        self._thread = threading.Thread(target=self._run, name="deskeye-tray", daemon=True)
        self._thread.start()

    def set_state(self, state: str) -> None:
        with self._lock:                     # called from the job, hotkey and supervisor threads
            self._set_state(state)

    def _set_state(self, state: str) -> None:
        self.state = state
        icon = self._icon
        if icon is not None:
            try:
                icon.icon = draw_icon(state)
                icon.title = self._title()
                icon.update_menu()
            except Exception as exc:     # the backend may not support updates before it runs
                log.debug("tray update failed: %s", exc)

    def stop(self, timeout_s: float = STOP_WAIT_S) -> None:
        icon, self._icon = self._icon, None
        if icon is None:
            return
        stopper = threading.Thread(target=icon.stop, name="deskeye-tray-stop", daemon=True)
        stopper.start()
        stopper.join(timeout_s)
        if self._thread is not None:
            self._thread.join(timeout_s)
        del icon, stopper
        gc.collect()        # pystray's icon closes its X connection when collected: now, while X is still up

    def _title(self) -> str:
        return f"DeskEye ({self.state})"

    def _run(self) -> None:
        try:
            self._icon.run()
        except Exception:
            log.exception("The tray icon stopped; the hotkeys and the overlay keep working")


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
