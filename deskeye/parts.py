"""What the desktop app is made of: every part `build_app` (deskeye/compose.py) builds from the settings and `App`
(deskeye/app.py) runs. The parts that call back into the app (overlay, tray, hotkeys, trigger) come as makers: the
app hands them its actions when it starts them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from deskeye.ask.first_look import FirstLookPart
from deskeye.ask.memory import ConversationMemory
from deskeye.ask.providers import QuickAnswerer, ScreenMemory
from deskeye.ask.router import Router
from deskeye.hooks.runner import HookRunner
from deskeye.jobs import JobQueue
from deskeye.see.capture import ScreenGrabber
from deskeye.see.change import ChangeDetector
from deskeye.see.geometry import Rect
from deskeye.see.window_list import SessionWindows
from deskeye.see.x11_windows import OwnWindows
from deskeye.ui.hotkeys import Hotkeys
from deskeye.ui.portal_shortcuts import PortalShortcuts
from deskeye.ui.menu import MenuActions
from deskeye.ui.notify import Notifier
from deskeye.ui.overlay import Overlay
from deskeye.ui.tray import Tray
from deskeye.ui.trigger import TriggerListener
from deskeye.worker.client import WorkerClient
from deskeye.worker.supervisor import WorkerSupervisor


@dataclass(frozen=True)
class AppParts:
    """Everything `App` runs, each built from the settings by `build_app`."""
    own_windows: OwnWindows
    window_list: SessionWindows              # the session's windows: privacy and masks (X11, sway IPC, none)
    grabber: ScreenGrabber
    change: ChangeDetector
    jobs: JobQueue
    memory: ConversationMemory               # the conversation, carried into the next prompt
    screen_memory: ScreenMemory              # what was seen last ("what was that?")
    supervisor: WorkerSupervisor
    client: WorkerClient
    first_look: FirstLookPart | None         # None: one stage (the OCR engine alone, or worker.ocr_first = false)
    router: Callable[[], Router]             # loads (or trains) the router on the first typed question
    quick: QuickAnswerer
    notifier: Notifier
    hooks: HookRunner
    make_overlay: Callable[[Rect, MenuActions], Overlay]
    make_tray: Callable[[MenuActions], Tray] | None                      # None: no tray icon
    make_hotkeys: Callable[..., Hotkeys | PortalShortcuts] | None        # None: no hotkeys
    make_trigger: Callable[[MenuActions], TriggerListener] | None        # None: no `deskeye trigger` socket
