"""DeskEye's menu: one list of entries, shown by the tray icon (GTK) and by a right-click on the overlay (Tk).

Each entry calls one plain function of `MenuActions` that returns at once (it only enqueues work or posts
to the overlay's thread), so either toolkit's thread may call it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from deskeye.language import _


def _noop() -> None:
    pass


@dataclass
class MenuActions:
    describe_now: Callable[[], None] = _noop
    ask: Callable[[], None] = _noop
    toggle_pause: Callable[[], None] = _noop
    open_settings: Callable[[], None] = _noop
    quit: Callable[[], None] = _noop
    is_paused: Callable[[], bool] = lambda: False


@dataclass(frozen=True)
class MenuEntry:
    label: str
    action: Callable[[], None]


def menu_entries(actions: MenuActions) -> list[MenuEntry]:
    """The entries as they should read now (Pause or Resume), in the user's language."""
    return [
        MenuEntry(_("Describe now"), actions.describe_now),
        MenuEntry(_("Ask…"), actions.ask),
        MenuEntry(_("Resume") if actions.is_paused() else _("Pause"), actions.toggle_pause),
        MenuEntry(_("Open settings"), actions.open_settings),
        MenuEntry(_("Quit"), actions.quit),
    ]
