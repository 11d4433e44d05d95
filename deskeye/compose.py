"""`build_app(settings)`: the one place where the desktop app's parts are built and tied together.

Data flows capture -> (privacy, change) -> job queue -> route -> worker -> overlay/hooks; each part is made here from
the settings, in that order, and handed to `App` (deskeye/app.py), which only runs them. Nothing here starts a
thread, opens a window or launches a worker: that happens in `App.start()`.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Callable

from deskeye.app import App
from deskeye.ask.first_look import FirstLookPart, wants_first_look
from deskeye.ask.memory import ConversationMemory
from deskeye.ask.providers import QuickAnswerer, ScreenMemory
from deskeye.ask.router import Router
from deskeye.hooks.loading import build_runner
from deskeye.jobs import JobQueue
from deskeye.live_settings import RUN_STATE_NAME, SettingsWatcher
from deskeye.parts import AppParts
from deskeye.see.capture import ScreenGrabber
from deskeye.see.change import ChangeDetector
from deskeye.see.geometry import Rect
from deskeye.see.window_list import SessionWindows
from deskeye.see.x11_windows import OwnWindows
from deskeye.settings import Settings
from deskeye.ui.hotkey_route import session_hotkeys
from deskeye.ui.menu import MenuActions
from deskeye.ui.notify import Notifier
from deskeye.ui.overlay import Overlay
from deskeye.ui.tray import Tray
from deskeye.ui.trigger import TriggerListener
from deskeye.worker.client import WorkerClient
from deskeye.worker.supervisor import WorkerSupervisor

PART_NAMES = frozenset(field.name for field in dataclasses.fields(AppParts))


def build_app(settings: Settings, *, region: str | None = None, settings_path: Path | None = None,
              use_tray: bool = True, use_hotkeys: bool = True, use_trigger: bool = False,
              temp_root: Path | None = None, **given: Any) -> App:
    """Every part of the app, built from `settings`; a part named in `given` (an AppParts field) is used instead.
    Temporary files (the worker's state folder, the tray's icons) go under `temp_root` (None: the system temp
    folder), and so does the run state (the settings in effect, for `deskeye settings`; None: none written). The
    settings file the tray opens, and the app watches to apply its changes while running, is `settings_path`
    (None: the one in the config folder). The `deskeye trigger` socket is one per user, in the runtime folder: only
    `deskeye run` asks for it (`use_trigger`), so an app built inside another process never takes the user's."""
    unknown = set(given) - PART_NAMES
    if unknown:
        raise TypeError(f"build_app() got parts it does not know: {', '.join(sorted(unknown))}")

    def part(name: str, make: Callable[[], Any]) -> Any:
        return given[name] if name in given else make()

    own_windows = part("own_windows", OwnWindows)
    window_list = part("window_list", lambda: SessionWindows(own_windows))
    capture = settings.capture
    grabber = part("grabber", lambda: ScreenGrabber.for_settings(settings, region, mask=own_windows.own_rects))
    change = part("change", lambda: ChangeDetector(capture.change_threshold, capture.min_changed_percent,
                                                   capture.small_change_interval_s))
    supervisor = part("supervisor", lambda: WorkerSupervisor(settings, temp_root=temp_root))
    screen_memory = part("screen_memory", ScreenMemory)
    notifier = part("notifier", Notifier)
    parts = AppParts(
        own_windows=own_windows, window_list=window_list, grabber=grabber, change=change,
        jobs=part("jobs", JobQueue),
        memory=part("memory", lambda: ConversationMemory(settings.memory.turns)),
        screen_memory=screen_memory,
        supervisor=supervisor,
        client=part("client", lambda: WorkerClient(supervisor, settings)),
        first_look=part("first_look", lambda: (FirstLookPart.build(settings, temp_root=temp_root)
                                               if wants_first_look(settings.worker) else None)),
        router=part("router", lambda: functools.cache(functools.partial(Router.load, settings))),
        quick=part("quick", lambda: QuickAnswerer(settings, screen_memory)),
        notifier=notifier,
        hooks=part("hooks", lambda: build_runner(settings, notifier)),
        make_overlay=part("make_overlay", lambda: _overlay_maker(settings, own_windows, change)),
        make_tray=part("make_tray", lambda: _tray_maker(settings, temp_root) if use_tray else None),
        make_hotkeys=part("make_hotkeys", lambda: functools.partial(session_hotkeys, settings.hotkeys)
                          if use_hotkeys else None),
        make_trigger=part("make_trigger", lambda: TriggerListener if use_trigger and TriggerListener.is_supported()
                          else None),
    )
    path = settings_path or settings.config_dir / "settings.toml"
    state_file = temp_root / RUN_STATE_NAME if temp_root is not None else None
    live_settings = SettingsWatcher(path, settings, state_file=state_file)
    return App(settings, parts, settings_path=path, live_settings=live_settings)


def _overlay_maker(settings: Settings, own_windows: OwnWindows,
                   change: ChangeDetector) -> Callable[[Rect, MenuActions], Overlay]:
    """The overlay; while its Ask box or menu is open (and a moment after), `change` holds automatic describes."""
    def own_window(is_open: bool) -> None:
        if is_open:
            change.own_window_opened()
        else:
            change.own_window_closed()
    return lambda area, actions: Overlay(settings.overlay, area, menu_actions=actions, own_windows=own_windows,
                                         on_own_window=own_window)


def _tray_maker(settings: Settings, temp_root: Path | None) -> Callable[[MenuActions], Tray]:
    return lambda actions: Tray(actions, ask_hotkey=settings.hotkeys.ask, temp_root=temp_root)
