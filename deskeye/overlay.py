"""The overlay: a small translucent, borderless, always-on-top window in a corner of the monitor
(`overlay.position`, default bottom-right, inside the work area the panels leave), and the Ask box.

One thread owns Tk. Other threads never touch it: they put commands on a queue that the Tk thread
polls with `after()`. `show(content)` is the one way to put something in it (call it again with longer
text to grow a streamed answer). The window never takes keyboard focus (no focus on show, `takefocus=0`,
override-redirect), so typing goes on where it was. It fades out after `overlay.fade_after_s`, except while an
answer is on its way ("thinking", or a first look (OCR) while a vision model answers).
A right-click on it opens DeskEye's menu (deskeye/menu.py). Every window it makes is registered with
`OwnWindows`, so capture masks it out of the frames.
"""

from __future__ import annotations

import enum
import gc
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Callable

from deskeye.errors import DeskEyeError
from deskeye.geometry import Rect
from deskeye.menu import MenuActions, menu_entries
from deskeye.placement import ask_box_origin, overlay_rect
from deskeye.settings import OverlaySettings

log = logging.getLogger(__name__)

WINDOW_TITLE = "DeskEye overlay"
ASK_TITLE = "Ask DeskEye"
THINKING_TEXT = "thinking…"
POLL_MS = 50                  # how often the Tk thread reads its command queue
RELIFT_MS = 1000              # re-raise while shown, so it stays above newly opened windows
FADE_STEPS = 8
FADE_STEP_MS = 50
PAD_PX = 10
MIN_HEIGHT_PX = 40
MAX_SUMMARY_CHARS = 1000      # what the window shows at most (answers are 200; notices and errors a few lines)
MAX_KEY_OBJECTS = 16
MAX_OBJECT_CHARS = 80
ELLIPSIS = "…"


class Kind(enum.StrEnum):
    ANSWER = "answer"
    THINKING = "thinking"
    ERROR = "error"
    NOTICE = "notice"
    FIRST_LOOK = "first_look"    # the OCR engine's answer, shown while a vision model answers (deskeye/first_look.py)


COLOURS = {Kind.ANSWER: "#1f2430", Kind.THINKING: "#27304a", Kind.ERROR: "#5a1f24", Kind.NOTICE: "#3a3a3a",
           Kind.FIRST_LOOK: "#24343a"}
HEADINGS = {Kind.ANSWER: "DeskEye", Kind.THINKING: "DeskEye · thinking…", Kind.ERROR: "DeskEye · error",
            Kind.NOTICE: "DeskEye", Kind.FIRST_LOOK: "DeskEye · first look (OCR) · the model is answering…"}
#: kinds that stay until the next content replaces them: an answer is on its way
WAITING_KINDS = frozenset({Kind.THINKING, Kind.FIRST_LOOK})


@dataclass(frozen=True)
class OverlayContent:
    """What the window shows, cut to what it can show: text from the screen (a window title in a notice, an
    error quoting input) can be megabytes, and Tk would lay all of it out on its one thread."""
    kind: Kind
    summary: str
    key_objects: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "kind", Kind(self.kind))
        object.__setattr__(self, "summary", bounded_text(self.summary, MAX_SUMMARY_CHARS))
        objects = tuple(bounded_text(o, MAX_OBJECT_CHARS) for o in tuple(self.key_objects)[:MAX_KEY_OBJECTS])
        object.__setattr__(self, "key_objects", objects)


def bounded_text(text: str, max_chars: int) -> str:
    """`text` if it has at most `max_chars` characters, else its head cut to `max_chars` with an ellipsis."""
    text = str(text)
    return text if len(text) <= max_chars else text[:max_chars - 1] + ELLIPSIS


class Overlay:
    def __init__(self, settings: OverlaySettings, monitor: Rect | None = None, *,
                 on_shown: Callable[[OverlayContent | None], None] = lambda content: None,
                 menu_actions: MenuActions | None = None, own_windows=None):
        self.settings = settings
        self.monitor = monitor                 # None = the whole X screen
        self.on_shown = on_shown               # called on the Tk thread with what is now shown (None = hidden)
        self.menu_actions = menu_actions       # None = no right-click menu
        self.own_windows = own_windows         # deskeye.x11_windows.OwnWindows: our windows are masked out
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

    def show(self, content: OverlayContent) -> None:
        """Show `content` (replacing what is shown; the same kind with longer text grows a streamed answer)."""
        self._post(lambda: self._render(content))

    def hide(self) -> None:
        self._post(self._withdraw)

    def open_ask_dialog(self, on_submit: Callable[[str], None]) -> None:
        """The Ask box near the overlay; Enter calls `on_submit(question)` on the Tk thread (it must only
        enqueue), Esc closes it."""
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
        window = tk.Toplevel(root, takefocus=0, class_="DeskEye")
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
        for widget in (window, frame, heading, summary, objects):
            widget.bind("<Button-3>", lambda event: self._popup_menu(event.x_root, event.y_root))
        window.update_idletasks()
        self._register(window.wm_frame())
        self._tk = {"tk": tk, "root": root, "window": window, "frame": frame, "heading": heading,
                    "summary": summary, "objects": objects}

    def _register(self, window_id: str | int) -> None:
        if self.own_windows is not None:
            self.own_windows.register(int(window_id, 16) if isinstance(window_id, str) else window_id)

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

    def _area(self, widget) -> Rect:
        """The monitor, less the panels (the X work area), as far as it is known."""
        area = self.monitor or Rect(0, 0, widget.winfo_screenwidth(), widget.winfo_screenheight())
        from deskeye.x11_windows import work_area
        return (work_area() or area).clip(area) or area

    def _place(self, window) -> None:
        window.update_idletasks()
        s = self.settings
        height = max(self._tk["frame"].winfo_reqheight(), MIN_HEIGHT_PX)
        rect = overlay_rect(self._area(window), s.width_px, height, s.margin_px, s.position)
        window.geometry(f"{rect.width}x{rect.height}+{rect.left}+{rect.top}")
        self._tk["height"] = rect.height

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
        if kind not in WAITING_KINDS and self.settings.fade_after_s > 0:
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
        dialog = tk.Toplevel(self._tk["root"], class_="DeskEye")
        dialog.title(ASK_TITLE)
        dialog.attributes("-topmost", True)
        tk.Label(dialog, text="Ask DeskEye about your screen:", anchor="w").pack(fill="x", padx=8, pady=(8, 2))
        entry = tk.Entry(dialog, width=48)
        entry.pack(fill="x", padx=8, pady=(0, 8))

        def close(_event=None):
            self._tk["ask"] = self._tk["ask_entry"] = None
            if self.own_windows is not None:
                self.own_windows.unregister(int(dialog.wm_frame(), 16))
            dialog.destroy()

        def submit(_event=None):
            question = entry.get().strip()
            close()
            if question:
                on_submit(question)

        entry.bind("<Return>", submit)
        entry.bind("<Escape>", close)
        dialog.protocol("WM_DELETE_WINDOW", close)
        s = self.settings
        x, y = ask_box_origin(self._area(dialog), s.width_px, s.margin_px, s.position,
                              self._tk.get("height", MIN_HEIGHT_PX))
        dialog.geometry(f"+{x}+{y}")
        self._tk["ask"], self._tk["ask_entry"] = dialog, entry
        dialog.update_idletasks()
        self._register(dialog.wm_frame())
        entry.focus_force()

    def _popup_menu(self, x_root: int, y_root: int) -> None:
        """DeskEye's menu at the pointer (right-click on the overlay); Tk thread only."""
        if self.menu_actions is None:
            return
        tk = self._tk["tk"]
        old = self._tk.get("menu")
        if old is not None:
            if self.own_windows is not None:
                self.own_windows.unregister(old.winfo_id())
            old.destroy()
        menu = tk.Menu(self._tk["root"], tearoff=0)
        for entry in menu_entries(self.menu_actions):
            menu.add_command(label=entry.label, command=lambda action=entry.action: self._run_action(action))
        self._tk["menu"] = menu
        menu.update_idletasks()
        self._register(menu.winfo_id())
        try:
            menu.tk_popup(x_root, y_root)
        finally:
            menu.grab_release()

    @staticmethod
    def _run_action(action: Callable[[], None]) -> None:
        try:
            action()
        except Exception:
            log.exception("menu action failed")
