"""The overlay: a small translucent, borderless, always-on-top window at the top-right of the monitor.

One thread owns Tk. Other threads never touch it: they put commands on a queue that the Tk thread
polls with `after()`. The window never takes keyboard focus (no focus on show, `takefocus=0`,
override-redirect), so typing goes on where it was. It fades out after `overlay.fade_after_s`.
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Callable

from deskeye.capture import Rect
from deskeye.errors import DeskEyeError
from deskeye.settings import OverlaySettings

log = logging.getLogger(__name__)

WINDOW_TITLE = "DeskEye overlay"
ASK_TITLE = "DeskEye - ask"
THINKING_TEXT = "thinking…"
POLL_MS = 50                  # how often the Tk thread reads its command queue
RELIFT_MS = 1000              # re-raise while shown, so it stays above newly opened windows
FADE_STEPS = 8
FADE_STEP_MS = 50
PAD_PX = 10
COLOURS = {"answer": "#1f2430", "thinking": "#27304a", "error": "#5a1f24", "notice": "#3a3a3a"}
HEADINGS = {"answer": "DeskEye", "thinking": "DeskEye · thinking…", "error": "DeskEye · error",
            "notice": "DeskEye"}


@dataclass(frozen=True)
class OverlayContent:
    kind: str                          # "answer" | "thinking" | "error" | "notice"
    summary: str
    key_objects: tuple[str, ...] = ()


class Overlay:
    def __init__(self, settings: OverlaySettings, monitor: Rect | None = None, *,
                 on_shown: Callable[[OverlayContent | None], None] = lambda content: None):
        self.settings = settings
        self.monitor = monitor                 # None = the whole X screen
        self.on_shown = on_shown               # called on the Tk thread with what is now shown (None = hidden)
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._start_error: str = ""
        self._lock = threading.Lock()
        self._shown: OverlayContent | None = None
        self._shown_changed = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._tk: dict = {}                    # Tk objects; touched only by the Tk thread
        self._fade_job = None

    # ------------------------------------------------------------ any thread

    def start(self, timeout_s: float = 10.0) -> None:
        self._thread = threading.Thread(target=self._run, name="deskeye-overlay")
        self._thread.start()
        if not self._ready.wait(timeout_s) or self._start_error:
            self._stop.set()
            raise DeskEyeError(f"The overlay window could not start: {self._start_error or 'Tk did not answer'}. "
                               "Check that DISPLAY points to a running X server and that Tk is installed.")

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def show_answer(self, summary: str, key_objects: list[str] | tuple[str, ...] = ()) -> None:
        self._post(lambda: self._render(OverlayContent("answer", summary, tuple(key_objects))))

    def show_thinking(self, text: str = THINKING_TEXT) -> None:
        self._post(lambda: self._render(OverlayContent("thinking", text)))

    def show_error(self, message: str) -> None:
        self._post(lambda: self._render(OverlayContent("error", message)))

    def show_notice(self, message: str) -> None:
        self._post(lambda: self._render(OverlayContent("notice", message)))

    def hide(self) -> None:
        self._post(self._withdraw)

    def open_ask_dialog(self, on_submit: Callable[[str], None]) -> None:
        """A small entry window; `on_submit(question)` runs on the Tk thread, so it must only enqueue."""
        self._post(lambda: self._open_ask(on_submit))

    def call_in_tk(self, fn: Callable[[], None]) -> None:
        self._post(fn)

    @property
    def shown(self) -> OverlayContent | None:
        """What the window shows now, read back from its widgets (None when hidden)."""
        with self._lock:
            return self._shown

    @property
    def shown_text(self) -> str:
        shown = self.shown
        return shown.summary if shown else ""

    def wait_for(self, predicate: Callable[[OverlayContent | None], bool], timeout_s: float) -> OverlayContent | None:
        """Block until `predicate(shown)` holds (for callers that need to know the user saw something)."""
        with self._shown_changed:
            self._shown_changed.wait_for(lambda: predicate(self._shown), timeout_s)
            return self._shown

    def _post(self, fn: Callable[[], None]) -> None:
        if not self._stop.is_set():
            self._commands.put(fn)

    def _set_shown(self, content: OverlayContent | None) -> None:
        with self._shown_changed:
            self._shown = content
            self._shown_changed.notify_all()
        try:
            self.on_shown(content)
        except Exception:
            log.exception("overlay on_shown callback failed")

    # ------------------------------------------------------------ Tk thread only

    def _run(self) -> None:
        try:
            self._build()
        except Exception as exc:       # TclError: no display, no Tk runtime
            self._start_error = str(exc)
            self._ready.set()
            return
        self._ready.set()
        root = self._tk["root"]
        root.after(POLL_MS, self._poll)
        try:
            root.mainloop()
        finally:
            self._tk.clear()           # Tk objects must die on the thread that made them:
            del root                   # drop every reference, then collect the widget cycles here
            gc.collect()
            self._set_shown(None)

    def _build(self) -> None:
        import tkinter as tk
        root = tk.Tk(className="DeskEye")
        root.withdraw()
        window = tk.Toplevel(root, takefocus=0)
        window.withdraw()
        window.title(WINDOW_TITLE)
        window.overrideredirect(True)
        window.attributes("-topmost", True)
        window.attributes("-alpha", self.settings.alpha)
        frame = tk.Frame(window, padx=PAD_PX, pady=PAD_PX, takefocus=0)
        frame.pack(fill="both", expand=True)
        wrap_px = self.settings.width_px - 2 * PAD_PX
        font = ("DejaVu Sans", self.settings.font_size)
        heading = tk.Label(frame, anchor="w", justify="left", fg="#9fb3d9", takefocus=0,
                           font=(font[0], max(self.settings.font_size - 2, 7)))
        summary = tk.Label(frame, anchor="w", justify="left", fg="white", wraplength=wrap_px, takefocus=0, font=font)
        objects = tk.Label(frame, anchor="w", justify="left", fg="#d6c98a", wraplength=wrap_px, takefocus=0,
                           font=(font[0], max(self.settings.font_size - 1, 7)))
        for label in (heading, summary, objects):
            label.pack(fill="x", anchor="w")
        window.update_idletasks()
        self._tk = {"tk": tk, "root": root, "window": window, "frame": frame, "heading": heading,
                    "summary": summary, "objects": objects}

    def _poll(self) -> None:
        root = self._tk["root"]
        if self._stop.is_set():
            root.destroy()
            return
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            try:
                command()
            except Exception:
                log.exception("Overlay command failed")
        root.after(POLL_MS, self._poll)

    def _render(self, content: OverlayContent) -> None:
        tk = self._tk
        colour = COLOURS.get(content.kind, COLOURS["notice"])
        for name in ("window", "frame", "heading", "summary", "objects"):
            tk[name].configure(bg=colour)
        tk["heading"].configure(text=HEADINGS.get(content.kind, "DeskEye"))
        tk["summary"].configure(text=content.summary)
        tk["objects"].configure(text="   ".join(f"• {o}" for o in content.key_objects))
        window = tk["window"]
        window.attributes("-alpha", self.settings.alpha)
        self._place(window)
        window.deiconify()
        window.lift()
        self._schedule_fade(content.kind)
        self._schedule_relift()
        objects_text = tk["objects"].cget("text")
        shown_objects = tuple(o[2:] for o in objects_text.split("   ")) if objects_text else ()
        self._set_shown(OverlayContent(content.kind, tk["summary"].cget("text"), shown_objects))

    def _place(self, window) -> None:
        window.update_idletasks()
        area = self.monitor or Rect(0, 0, window.winfo_screenwidth(), window.winfo_screenheight())
        width = self.settings.width_px
        height = max(self._tk["frame"].winfo_reqheight(), 40)
        x = area.left + area.width - width - self.settings.margin_px
        y = area.top + self.settings.margin_px
        window.geometry(f"{width}x{height}+{x}+{y}")

    def _schedule_relift(self) -> None:
        window = self._tk["window"]
        if self._tk.get("relift_job"):
            window.after_cancel(self._tk["relift_job"])

        def relift():
            if window.winfo_ismapped():
                window.attributes("-topmost", True)
                window.lift()
                self._tk["relift_job"] = window.after(RELIFT_MS, relift)

        self._tk["relift_job"] = window.after(RELIFT_MS, relift)

    def _schedule_fade(self, kind: str) -> None:
        window = self._tk["window"]
        if self._fade_job is not None:
            window.after_cancel(self._fade_job)
            self._fade_job = None
        if kind != "thinking" and self.settings.fade_after_s > 0:
            self._fade_job = window.after(int(self.settings.fade_after_s * 1000), lambda: self._fade_step(FADE_STEPS))

    def _fade_step(self, steps_left: int) -> None:
        window = self._tk["window"]
        if steps_left <= 0:
            self._fade_job = None
            self._withdraw()
            return
        window.attributes("-alpha", self.settings.alpha * steps_left / (FADE_STEPS + 1))
        self._fade_job = window.after(FADE_STEP_MS, lambda: self._fade_step(steps_left - 1))

    def _withdraw(self) -> None:
        window = self._tk["window"]
        if self._fade_job is not None:
            window.after_cancel(self._fade_job)
            self._fade_job = None
        window.withdraw()
        self._set_shown(None)

    def _open_ask(self, on_submit: Callable[[str], None]) -> None:
        tk = self._tk["tk"]
        if self._tk.get("ask") is not None:
            self._tk["ask"].lift()
            self._tk["ask_entry"].focus_force()
            return
        dialog = tk.Toplevel(self._tk["root"])
        dialog.title(ASK_TITLE)
        dialog.attributes("-topmost", True)
        tk.Label(dialog, text="Ask DeskEye about your screen:", anchor="w").pack(fill="x", padx=8, pady=(8, 2))
        entry = tk.Entry(dialog, width=48)
        entry.pack(fill="x", padx=8, pady=(0, 8))

        def close(_event=None):
            self._tk["ask"] = self._tk["ask_entry"] = None
            dialog.destroy()

        def submit(_event=None):
            question = entry.get().strip()
            close()
            if question:
                on_submit(question)

        entry.bind("<Return>", submit)
        entry.bind("<Escape>", close)
        dialog.protocol("WM_DELETE_WINDOW", close)
        area = self.monitor or Rect(0, 0, dialog.winfo_screenwidth(), dialog.winfo_screenheight())
        dialog.geometry(f"+{area.left + area.width - self.settings.width_px - self.settings.margin_px}"
                        f"+{area.top + self.settings.margin_px + 140}")
        self._tk["ask"], self._tk["ask_entry"] = dialog, entry
        dialog.update_idletasks()
        entry.focus_force()
