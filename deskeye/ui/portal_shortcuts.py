"""Global shortcuts through xdg-desktop-portal's GlobalShortcuts (KDE Plasma 5.27+, GNOME 48+): keys that reach
DeskEye while a native Wayland window has focus, where pynput (deskeye/ui/hotkeys.py) sees only X11 windows' keys.

DeskEye asks the desktop for three shortcuts (describe, ask, pause), each with the key of its `hotkeys` setting as
the preferred one; the desktop decides, and the user can change them in its own settings (KDE Plasma: System
Settings › Shortcuts › "deskeye"; KDE names the group after the session token). What the desktop bound is
`bound`, as the desktop words it ("Ctrl+Alt+D"), and the app says that. The desktop's `Activated` signal calls the
action, which only enqueues (as the pynput callbacks do).

One thread owns the portal connection: it creates the session, then runs the connection's own GLib main context
(never the tray's) until `stop()`, waking every WAKE_S so that it stops at once. Closing the connection ends the
session, and with it the shortcuts.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable, Mapping

from deskeye.errors import DeskEyeError
from deskeye.hotkey_syntax import canonical_part, split_parts
from deskeye.language import N_, _
from deskeye.settings import HotkeySettings

log = logging.getLogger(__name__)

INTERFACE = "org.freedesktop.portal.GlobalShortcuts"
SESSION_TOKEN = "deskeye"        # KDE Plasma lists the shortcuts under this name
START_TIMEOUT_S = 30.0           # the first call may start the portal and its backend
STOP_TIMEOUT_S = 2.0
ACTIONS = ("describe", "ask", "pause")
DESCRIPTIONS = {"describe": N_("Describe the watched region now"), "ask": N_("Open DeskEye's Ask box"),
                "pause": N_("Pause or resume DeskEye's watching")}
NOT_STARTED = N_("The desktop's global shortcuts (xdg-desktop-portal) could not be set up: {cause}")

# pynput's names -> the portal's (the XDG shortcuts format: modifiers, then an XKB keysym name)
_MODIFIERS = {"ctrl": "CTRL", "alt": "ALT", "shift": "SHIFT", "cmd": "LOGO", "alt_gr": "ALT"}
_KEYSYMS = {"backspace": "BackSpace", "caps_lock": "Caps_Lock", "delete": "Delete", "down": "Down", "end": "End",
            "enter": "Return", "esc": "Escape", "home": "Home", "left": "Left", "page_down": "Next",
            "page_up": "Prior", "right": "Right", "space": "space", "tab": "Tab", "up": "Up", "insert": "Insert",
            "menu": "Menu", "num_lock": "Num_Lock", "pause": "Pause", "print_screen": "Print",
            "scroll_lock": "Scroll_Lock", "media_play_pause": "XF86AudioPlay", "media_volume_mute": "XF86AudioMute",
            "media_volume_down": "XF86AudioLowerVolume", "media_volume_up": "XF86AudioRaiseVolume",
            "media_previous": "XF86AudioPrev", "media_next": "XF86AudioNext",
            **{f"f{i}": f"F{i}" for i in range(1, 21)}}
_CHARACTERS = {"+": "plus", "-": "minus", ",": "comma", ".": "period", "/": "slash", ";": "semicolon",
               "'": "apostrophe", "[": "bracketleft", "]": "bracketright", "\\": "backslash", "=": "equal",
               "`": "grave", " ": "space"}


def portal_trigger(hotkey: str) -> str:
    """A pynput hotkey ("<ctrl>+<alt>+d") in the portal's format ("CTRL+ALT+d"); "" where a part has no portal name
    (a virtual key code): the desktop then picks no key and the user binds one in its settings."""
    try:
        parts = [canonical_part(p) for p in split_parts(hotkey)]
    except ValueError:
        return ""
    modifiers, keys = [], []
    for part in parts:
        name = part[1:-1] if len(part) > 1 else part
        base = name.removesuffix("_l").removesuffix("_r") if name not in ("alt_gr",) else name
        if len(part) > 1 and base in _MODIFIERS:
            modifiers.append(_MODIFIERS[base])
        elif len(part) == 1:
            keys.append(_CHARACTERS.get(part, part))
        elif name in _KEYSYMS:
            keys.append(_KEYSYMS[name])
        else:
            return ""
    return "+".join([*dict.fromkeys(modifiers), *keys])


def portal_offers_shortcuts(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the session bus's portal offers GlobalShortcuts (its `version` property is read: nothing is bound)."""
    from deskeye.see.portal_request import PortalBus
    try:
        bus = PortalBus(environ, timeout_s=START_TIMEOUT_S)
    except DeskEyeError:
        return False
    try:
        bus.property(INTERFACE, "version")
        return True
    except Exception as exc:  # noqa: BLE001 - GLib.Error: no portal, or this desktop's has no GlobalShortcuts
        log.debug("no GlobalShortcuts portal: %s", exc)
        return False
    finally:
        bus.close()


def _noop() -> None:
    pass


class PortalShortcuts:
    """The same shape as `Hotkeys` (start, stop, is_running), through the desktop's GlobalShortcuts portal."""

    def __init__(self, settings: HotkeySettings, *, on_describe: Callable[[], None] = _noop,
                 on_pause: Callable[[], None] = _noop, on_ask: Callable[[], None] = _noop,
                 environ: Mapping[str, str] = os.environ):
        self.settings = settings
        self._actions = {"describe": on_describe, "pause": on_pause, "ask": on_ask}
        self._environ = dict(environ)
        self.bound: dict[str, str] = {}      # shortcut id -> the key the desktop bound, in its words ("" = none)
        self._stop = threading.Event()
        self._started = threading.Event()
        self._error: str = ""
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Create the portal session with the three shortcuts; DeskEyeError (the cause quoted) if it cannot."""
        self._thread = threading.Thread(target=self._run, name="deskeye-portal-shortcuts", daemon=True)
        self._thread.start()
        if not self._started.wait(START_TIMEOUT_S + 5) or self._error:
            self._stop.set()
            cause = self._error or _("no answer within {seconds:.0f} s").format(seconds=START_TIMEOUT_S)
            raise DeskEyeError(_(NOT_STARTED).format(cause=cause))

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._error

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        from deskeye.see.portal_request import PortalBus
        try:
            bus = PortalBus(self._environ, timeout_s=START_TIMEOUT_S)
        except DeskEyeError as exc:
            self._failed(str(exc))
            return
        try:
            session = f"{bus.session_path(SESSION_TOKEN)}"
            bus.on_signal(INTERFACE, "Activated", lambda params: self._activated(session, params))
            results = bus.request(INTERFACE, "CreateSession", "(a{sv})", ({
                "session_handle_token": bus.variant("s", SESSION_TOKEN),
                "shortcuts": bus.variant("a(sa{sv})", [self._shortcut(name) for name in ACTIONS])},),
                timeout_s=START_TIMEOUT_S)
            if results.get("session_handle", session) != session:
                session = results["session_handle"]
            self.bound = {name: str(info.get("trigger_description", "")) for name, info in results.get("shortcuts", [])}
            log.info("global shortcuts from the desktop: %s", self.bound)
            self._started.set()
            bus.serve(self._stop)
        except Exception as exc:  # noqa: BLE001 - a D-Bus or portal failure: said by start() or logged
            self._failed(str(exc))
        finally:
            bus.close()

    def _shortcut(self, name: str) -> tuple:
        from gi.repository import GLib
        options = {"description": GLib.Variant("s", _(DESCRIPTIONS[name]))}
        trigger = portal_trigger(getattr(self.settings, name))
        if trigger:
            options["preferred_trigger"] = GLib.Variant("s", trigger)
        return name, options

    def _activated(self, session: str, params) -> None:
        session_handle, shortcut, *_rest = params
        action = self._actions.get(shortcut)
        if session_handle != session or action is None:
            return
        try:
            action()
        except Exception:  # noqa: BLE001 - one failed action must not end the shortcuts
            log.exception("global shortcut %s failed", shortcut)

    def _failed(self, message: str) -> None:
        if self._started.is_set():
            log.warning("the desktop's global shortcuts stopped: %s", message)
        self._error = message or "?"
        self._started.set()
