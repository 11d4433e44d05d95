"""Global hotkeys (pynput): describe the screen now, pause/resume watching, open the Ask box.

pynput is imported only when the listener starts: it fails at import without a display. Callbacks run
on pynput's thread and must return at once (the app only enqueues). pynput's `stop()` returns only
after the next key event on X, so stopping runs it on a daemon thread with a bounded wait.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from deskeye.errors import DeskEyeError, SettingsError
from deskeye.hotkey_syntax import EXAMPLE, check_hotkey
from deskeye.settings import HotkeySettings

log = logging.getLogger(__name__)

STOP_WAIT_S = 1.0
START_TIMEOUT_S = 5.0


def _noop() -> None:
    pass


def parse_hotkey(text: str, key: str) -> None:
    """Raise SettingsError when `text` is not pynput hotkey syntax (e.g. "<ctrl>+<alt>+d"): the same check
    as the settings file's, then pynput's own."""
    check_hotkey(text, key)
    from pynput import keyboard
    try:
        keyboard.HotKey.parse(text)
    except ValueError as exc:
        raise SettingsError(f"{key} = {text!r} is not a valid hotkey ({exc}). Use pynput syntax, e.g. {EXAMPLE}.") \
            from None


class Hotkeys:
    def __init__(self, settings: HotkeySettings, *, on_describe: Callable[[], None] = _noop,
                 on_pause: Callable[[], None] = _noop, on_ask: Callable[[], None] = _noop):
        self.settings = settings
        self.on_describe = on_describe
        self.on_pause = on_pause
        self.on_ask = on_ask
        self._listener = None

    def start(self) -> None:
        actions = {"describe": self.on_describe, "pause": self.on_pause, "ask": self.on_ask}
        for name in actions:
            parse_hotkey(getattr(self.settings, name), f"hotkeys.{name}")
        from pynput import keyboard
        bindings = {getattr(self.settings, name): self._guard(action) for name, action in actions.items()}
        self._listener = keyboard.GlobalHotKeys(bindings)
        self._listener.daemon = True
        self._listener.name = "deskeye-hotkeys"
        self._listener.start()
        # Until the X record context is live (presses from now on count). pynput's wait() never returns
        # if the listener dies first (no RECORD extension), so it waits on a daemon thread, bounded.
        waiter = threading.Thread(target=self._listener.wait, name="deskeye-hotkeys-wait", daemon=True)
        waiter.start()
        waiter.join(START_TIMEOUT_S)
        if waiter.is_alive() or not self._listener.is_alive():
            self._listener = None
            raise DeskEyeError("The global hotkeys could not start: the X server did not accept the keyboard "
                               "listener (it needs the RECORD extension). Use the tray menu instead.")

    @property
    def is_running(self) -> bool:
        return self._listener is not None and self._listener.is_alive()

    def stop(self, timeout_s: float = STOP_WAIT_S) -> None:
        """Ask the listener to stop; wait at most `timeout_s` (it is a daemon thread either way)."""
        listener, self._listener = self._listener, None
        if listener is None:
            return
        stopper = threading.Thread(target=listener.stop, name="deskeye-hotkeys-stop", daemon=True)
        stopper.start()
        stopper.join(timeout_s)
        _wake_x_listener(listener)
        listener.join(timeout_s)

    @staticmethod
    def _guard(callback: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                callback()
            except Exception:          # an exception would end pynput's listener thread: log it instead
                log.exception("Hotkey action failed")
        return run


def _wake_x_listener(listener) -> None:
    """pynput 1.8's X listener sends its stop request on the connection that is blocked reading events,
    so it ends only at the next key press. Sending the same request on its second (idle) connection ends
    it now. Best-effort: any other backend or version simply keeps the documented behaviour."""
    display, context = getattr(listener, "_display_stop", None), getattr(listener, "_context", None)
    if display is None or context is None or not listener.is_alive():
        return
    try:
        display.record_disable_context(context)
        display.flush()
    except Exception as exc:       # the listener closed it meanwhile
        log.debug("could not wake the hotkey listener: %s", exc)
