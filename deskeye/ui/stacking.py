"""Where the overlay goes in the X stacking order: above other programs' windows, below DeskEye's own.

The overlay is override-redirect, so no window manager keeps it on top: it lifts itself when another program's window
covers it (one opened after the answer was shown). DeskEye's own windows (the tray's menu, the overlay's right-click
menu, the Ask box) are what the user is working in, so the overlay never goes over them: while one is open the
overlay stays, or goes, right under the lowest of them, and lifts itself again once they are closed.

Decided from one read of the window list (bottom to top, each marked as DeskEye's own or not, by
deskeye.see.x11_windows) and done with one ConfigureWindow request on the overlay's own X window, which needs no
window manager's help: the overlay is not managed.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Sequence

from deskeye.see.x11_windows import OwnWindows, XWindow, open_display

log = logging.getLogger(__name__)

MAX_DEPTH = 16                 # parents walked up to find a window's top level


class Move(enum.StrEnum):
    STAY = "stay"
    RAISE = "raise"        # to the top: another program's window covers the overlay
    BELOW = "below"        # right under `sibling`, the lowest of DeskEye's own open windows


@dataclass(frozen=True)
class StackMove:
    move: Move
    sibling: int | None = None


STAY = StackMove(Move.STAY)


def overlay_move(stack: Sequence[XWindow], overlay_id: int) -> StackMove:
    """What the overlay (top-level window `overlay_id`) should do, given the mapped top-level windows bottom to top."""
    ids = [w.window_id for w in stack]
    if overlay_id not in ids:
        return STAY                                      # not mapped (or gone): nothing to keep on top
    at = ids.index(overlay_id)
    own = [i for i, w in enumerate(stack) if w.is_own and w.window_id != overlay_id]
    if own:
        lowest = own[0]
        return StackMove(Move.BELOW, stack[lowest].window_id) if lowest < at else STAY
    overlay = stack[at].rect
    if any(w.rect.clip(overlay) is not None for w in stack[at + 1:]):
        return StackMove(Move.RAISE)
    return STAY


class OverlayStacking:
    """Keeps the overlay's window where `overlay_move` says. Used by the overlay's Tk thread only: the window list
    and the restacking go through that thread's own X connections (`close()` them at the thread's end)."""

    def __init__(self, own_windows: OwnWindows):
        self.own_windows = own_windows
        self._conn = None

    def top_level(self, window_id: int) -> int:
        """The top-level window (the root's child) that holds X window `window_id`: Tk's wrapper of a toplevel, or
        the window manager's frame around it. `window_id` itself where X cannot tell."""
        conn = self._connection()
        if conn is None:
            return window_id
        try:
            root_id = conn.screen().root.id
            window = conn.create_resource_object("window", window_id)
            for _ in range(MAX_DEPTH):
                parent = window.query_tree().parent
                if not parent or isinstance(parent, int) or parent.id == root_id:
                    return window.id
                window = parent
        except Exception as exc:                # gone meanwhile, or the X connection broke
            self._failed("finding a top-level window", exc)
        return window_id

    def apply(self, overlay_id: int) -> StackMove:
        move = overlay_move(self.own_windows.windows(), overlay_id)
        if move.move is not Move.STAY:
            self._restack(overlay_id, move)
        return move

    def _restack(self, overlay_id: int, move: StackMove) -> None:
        from Xlib import X
        from Xlib.error import CatchError
        conn = self._connection()
        if conn is None:
            return
        caught = CatchError()
        try:
            window = conn.create_resource_object("window", overlay_id)
            if move.move is Move.RAISE:
                window.configure(stack_mode=X.Above, onerror=caught)
            else:
                window.configure(sibling=move.sibling, stack_mode=X.Below, onerror=caught)
            conn.sync()
        except Exception as exc:               # the X connection broke: a new one next time
            self._failed("restacking the overlay", exc)
            return
        if caught.get_error():                 # the sibling closed meanwhile: the next look decides again
            log.debug("restacking the overlay (%s) failed: %s", move, caught.get_error())

    def _failed(self, what: str, exc: Exception) -> None:
        from Xlib.error import XError
        log.debug("%s failed: %s", what, exc)
        if not isinstance(exc, XError):        # not a window that went away: the connection itself
            self.close()

    def _connection(self):
        if self._conn is None:
            self._conn = open_display(self.own_windows.display_name, "to restack the overlay")
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:                  # the X server went away first: nothing left to close
                pass
            self._conn = None
        self.own_windows.close_thread()
