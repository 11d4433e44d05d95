"""Which way the user's keys reach DeskEye in this session: said once by the app when it starts, and by `deskeye
doctor`, with how to bind `deskeye trigger` where the global hotkeys cannot see every key.

X11: the global hotkeys (pynput over the X RECORD extension) see every key press. A Wayland session shows X11 windows
through Xwayland, and pynput sees only the keys pressed while one of those has focus, never in a native Wayland
window: there the desktop's GlobalShortcuts portal carries the keys where it has one (KDE Plasma 5.27+, GNOME 48+:
deskeye/ui/portal_shortcuts.py), and the route that works everywhere is the desktop's own keyboard settings running
`deskeye trigger describe` (deskeye/ui/trigger.py). `session_hotkeys` picks the listener for the session.
"""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from deskeye.hotkey_syntax import display_name
from deskeye.language import _
from deskeye.see.session import Session, SessionType
from deskeye.settings import HotkeySettings
from deskeye.ui.hotkeys import Hotkeys
from deskeye.ui.portal_shortcuts import PortalShortcuts, portal_offers_shortcuts


class Route(enum.StrEnum):
    GLOBAL_HOTKEYS = "global hotkeys"        # pynput sees every key (X11)
    PORTAL_SHORTCUTS = "portal shortcuts"    # the desktop's GlobalShortcuts portal (Wayland: KDE, GNOME 48+)
    TRIGGER_COMMAND = "trigger command"      # the desktop's keyboard settings run `deskeye trigger`


def session_hotkeys(settings: HotkeySettings, *, session: Session | None = None,
                    **actions: Callable[[], None]) -> Hotkeys | PortalShortcuts:
    """The global keys' listener for `session` (default: this process's): the desktop's GlobalShortcuts portal in a
    Wayland session whose portal offers it, else pynput (on Wayland it still hears keys pressed in X11 windows)."""
    session = session or Session.detect()
    if session.kind == SessionType.WAYLAND and portal_offers_shortcuts(session.environ):
        return PortalShortcuts(settings, environ=session.environ, **actions)
    return Hotkeys(settings, **actions)


@dataclass(frozen=True)
class HotkeyRoute:
    route: Route
    message: str                             # for the user, in their language


def trigger_command(action: str = "describe") -> str:
    """The command line to bind to a key: the full path of the `deskeye` beside this Python (a desktop's keyboard
    settings run commands without the terminal's PATH, so a virtual environment's `deskeye` would not be found)."""
    script = Path(sys.executable).parent / "deskeye"
    launcher = str(script) if script.exists() else f"{sys.executable} -m deskeye.cli"
    return f"{launcher} trigger {action}"


def hotkey_route(hotkeys: HotkeySettings, *, hotkeys_running: bool | None = None,
                 session: Session | None = None, portal_bound: Mapping[str, str] | None = None) -> HotkeyRoute:
    """The live route in `session` (default: this process's): the desktop's portal shortcuts where they are set up
    (`portal_bound`: shortcut -> the key the desktop bound, as it words it; {} or None: not set up); the global
    hotkeys where they run (`hotkeys_running`; None: wherever the session has a display) and see every key; else the
    trigger command, and how to bind it in GNOME and KDE Plasma."""
    session = session or Session.detect()
    if portal_bound is not None:
        unbound = _("no key yet")
        keys = {name: portal_bound.get(name) or unbound for name in ("describe", "ask", "pause")}
        return HotkeyRoute(Route.PORTAL_SHORTCUTS, _(
            "Global shortcuts from your desktop: describe {describe}, ask {ask}, pause {pause}; change them in your "
            "desktop's settings (KDE Plasma: System Settings › Shortcuts › deskeye). `deskeye trigger "
            "describe|ask|pause|resume` does the same from a command.").format(**keys))
    if hotkeys_running is None:
        hotkeys_running = session.kind != SessionType.NONE
    is_wayland = session.kind == SessionType.WAYLAND
    if hotkeys_running and not is_wayland:
        return HotkeyRoute(Route.GLOBAL_HOTKEYS, _(
            "Global hotkeys: describe {describe}, ask {ask}, pause {pause}; `deskeye trigger "
            "describe|ask|pause|resume` does the same from a command.").format(
                describe=display_name(hotkeys.describe), ask=display_name(hotkeys.ask),
                pause=display_name(hotkeys.pause)))
    why = (_("In a Wayland session the global hotkeys see only keys pressed in X11 windows.") if is_wayland
           else _("The global hotkeys are not available."))
    how = _("Bind `{command}` (and ask, pause, resume) to a key: GNOME: Settings › Keyboard › View and Customize "
            "Shortcuts › Custom Shortcuts; KDE Plasma: System Settings › Shortcuts › Add New › Command or "
            "Script.")
    return HotkeyRoute(Route.TRIGGER_COMMAND, f"{why} {how.format(command=trigger_command())}")
