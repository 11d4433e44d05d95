"""Which way the user's keys reach DeskEye in this session: said once by the app when it starts, and by `deskeye
doctor`, with how to bind `deskeye trigger` where the global hotkeys cannot see every key.

X11: the global hotkeys (pynput over the X RECORD extension) see every key press. A Wayland session shows X11 windows
through Xwayland, and pynput sees only the keys pressed while one of those has focus, never in a native Wayland
window: there the route that always works is the desktop's own keyboard settings running `deskeye trigger describe`
(deskeye/ui/trigger.py).
"""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass
from pathlib import Path

from deskeye.hotkey_syntax import display_name
from deskeye.language import _
from deskeye.see.session import Session, SessionType
from deskeye.settings import HotkeySettings


class Route(enum.StrEnum):
    GLOBAL_HOTKEYS = "global hotkeys"        # pynput sees every key (X11)
    TRIGGER_COMMAND = "trigger command"      # the desktop's keyboard settings run `deskeye trigger`


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
                 session: Session | None = None) -> HotkeyRoute:
    """The live route in `session` (default: this process's): the global hotkeys where they run (`hotkeys_running`;
    None: wherever the session has a display) and see every key; else the trigger command, and how to bind it in
    GNOME and KDE Plasma."""
    session = session or Session.detect()
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
