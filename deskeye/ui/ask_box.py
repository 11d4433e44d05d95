"""The Ask box: one line to type a question into, beside the overlay (`Overlay.open_ask_dialog`).

Unlike the overlay it is an ordinary, managed window that takes the keyboard: Enter hands the question over, Esc (or
the window manager's close button) closes it. It goes in the overlay's column on the overlay's inner side
(deskeye/see/placement.py), as wide as the overlay. A window manager frames a window only once it is mapped, and its
title bar must not hang over the overlay or off the monitor, so the box is placed again when its frame is known
(`_fit_frame`); the next box starts with the frame the last one had.

Tk thread only. The overlay owns that thread and its windows' bookkeeping, so it builds one AskBox and hands it the
few things of its own the box uses: the Tk root, the monitor reader, the overlay's height, the registry of DeskEye's
own windows (capture masks them out, the overlay never covers them) and the call that keeps the overlay under them.
"""

from __future__ import annotations

from typing import Any, Callable

from deskeye.language import N_, _
from deskeye.see.geometry import Monitor
from deskeye.see.placement import ask_box_rect_on, frame_extra
from deskeye.settings import OverlaySettings

ASK_TITLE = N_("Ask DeskEye")        # words the user reads are translated where shown: _(ASK_TITLE)
ASK_PROMPT = N_("Ask DeskEye about your screen:")
ASK_PAD_PX = 8                # logical pixels: times the monitor's scale (deskeye/see/monitors.py)
POLL_MS = 50                  # the step of the wait for the window manager's frame
MAX_FRAME_POLLS = 20          # after the box opens: how often (every POLL_MS) to look for that frame


def on_wayland() -> bool:
    """Whether this is a Wayland session (the box is an Xwayland window there: deskeye/see/session.py decides)."""
    from deskeye.see.session import Session, SessionType
    return Session.detect().kind == SessionType.WAYLAND


class AskBox:
    """The one Ask box of an overlay; every method runs on the overlay's Tk thread."""

    def __init__(self, root: Any, *, read_monitor: Callable[[Any], Monitor],
                 overlay_height_px: Callable[[Monitor], int],
                 register: Callable[[Any], tuple[int, ...]], unregister: Callable[[tuple[int, ...]], None],
                 keep_overlay_under: Callable[[], None], on_open_changed: Callable[[bool], None]):
        self._root = root
        self._read_monitor = read_monitor              # the monitor a widget is on, with its scale and work area
        self._overlay_height_px = overlay_height_px    # the overlay's height as last placed on that monitor
        self._register = register                      # marks a window DeskEye's own; returns the ids to unregister
        self._unregister = unregister
        self._keep_overlay_under = keep_overlay_under
        self._on_open_changed = on_open_changed        # True before the box takes the focus, False once closed
        self._dialog = None
        self._entry = None
        self._ids: tuple[int, ...] = ()
        self._frame_extra: tuple[int, int] = (0, 0)    # the window manager's title bar and borders, as last seen

    @property
    def is_open(self) -> bool:
        return self._dialog is not None

    def open(self, settings: OverlaySettings, on_submit: Callable[[str], None]) -> None:
        """Open the box (or bring the open one forward); Enter calls `on_submit(question)` with a non-blank
        question (it must only enqueue: this is the Tk thread)."""
        if self._dialog is not None:
            self._dialog.lift()
            self._entry.focus_force()
            return
        import tkinter as tk
        dialog = tk.Toplevel(self._root, class_="DeskEye")
        dialog.withdraw()                       # mapped once sized and placed
        dialog.title(_(ASK_TITLE))
        dialog.attributes("-topmost", True)
        if on_wayland():
            dialog.attributes("-type", "dialog")     # sway tiles a normal X11 window (half the screen); floats this
        monitor = self._read_monitor(dialog)
        pad = monitor.px(ASK_PAD_PX)
        tk.Label(dialog, text=_(ASK_PROMPT), anchor="w").pack(fill="x", padx=pad, pady=(pad, 2))
        entry = tk.Entry(dialog, width=1)       # as wide as the box, which is as wide as the overlay
        entry.pack(fill="x", padx=pad, pady=(0, pad))

        def close(_event=None):
            self._close(dialog)

        def submit(_event=None):
            question = entry.get().strip()
            self._close(dialog)
            if question:
                on_submit(question)

        entry.bind("<Return>", submit)
        entry.bind("<Escape>", close)
        dialog.protocol("WM_DELETE_WINDOW", close)
        dialog.update_idletasks()
        overlay_height = self._overlay_height_px(monitor)

        def place(extra: tuple[int, int]) -> None:
            """The frame (the window plus `extra`: the window manager's title bar and borders) in the box's place."""
            box = ask_box_rect_on(monitor, settings, dialog.winfo_reqheight() + extra[1], overlay_height)
            dialog.geometry(f"{box.width - extra[0]}x{box.height - extra[1]}+{box.left}+{box.top}")

        place(self._frame_extra)                # the frame as the last Ask box had it
        self._on_open_changed(True)             # before the focus moves to it
        dialog.bind("<Map>", lambda event: event.widget is dialog and self._keep_overlay_under())
        dialog.deiconify()
        dialog.after(POLL_MS, lambda: self._fit_frame(dialog, place, MAX_FRAME_POLLS))
        self._dialog, self._entry = dialog, entry
        dialog.update_idletasks()
        self._ids = self._register(dialog)
        entry.focus_force()

    def _close(self, dialog) -> None:
        if self._dialog is not dialog:          # closed already
            return
        self._dialog = self._entry = None
        self._unregister(self._ids)
        self._ids = ()
        dialog.destroy()
        self._on_open_changed(False)

    def _fit_frame(self, dialog, place: Callable[[tuple[int, int]], None], polls_left: int) -> None:
        """Once the window manager has framed the box, place it again if the frame is not the one it was placed
        for."""
        if self._dialog is not dialog:          # closed meanwhile
            return
        extra = frame_extra(dialog.wm_geometry(), dialog.winfo_rootx(), dialog.winfo_rooty())
        if extra is None:
            if polls_left > 0:                  # not framed yet (or no window manager)
                dialog.after(POLL_MS, lambda: self._fit_frame(dialog, place, polls_left - 1))
            return
        if extra != self._frame_extra:
            self._frame_extra = extra
            place(extra)
