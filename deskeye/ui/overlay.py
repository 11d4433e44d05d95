"""The overlay: a small translucent, borderless, always-on-top window in a corner of the monitor
(`overlay.position`, default bottom-right, inside the work area the panels leave), and the thread its Ask box
(deskeye/ui/ask_box.py) and menu run on.

One thread owns Tk. Other threads never touch it: they post commands that wake the Tk thread
(deskeye/ui/tk_commands.py). `show(content)` is the one way to put something in it (call it again with longer
text to grow a streamed answer). The window never takes keyboard focus (no focus on show, `takefocus=0`,
override-redirect), so typing goes on where it was. It fades out after `overlay.fade_after_s`, except while an
answer is on its way ("thinking", or a first look (OCR) while a vision model answers).
A right-click on it opens DeskEye's menu (deskeye/ui/menu.py). Every window it makes is registered with
`OwnWindows`, so capture masks it out of the frames. It stays above other programs' windows and below DeskEye's own
menus and Ask box (deskeye/ui/stacking.py); `on_own_window(True/False)` says when the Ask box or its menu opens
and closes (the change detector holds automatic describes meanwhile: deskeye/see/change.py). On Wayland it is an
Xwayland window, on top there too (measured on gnome-shell 43 and sway 1.7); each change of it is said to capture
(`own_windows_changed`), whose frames from the compositor lag X11 (deskeye/see/capture.py).
"""

from __future__ import annotations

import enum
import gc
import logging
import threading
from dataclasses import dataclass
from typing import Callable

from deskeye.errors import DeskEyeError
from deskeye.language import N_, _
from deskeye.see.capture import own_windows_changed
from deskeye.see.geometry import Monitor, Rect
from deskeye.see.x11_windows import OwnWindows
from deskeye.ui.ask_box import AskBox
from deskeye.ui.stacking import OverlayStacking
from deskeye.ui.tk_commands import TkCommands
from deskeye.ui.menu import MenuActions, menu_entries
from deskeye.see.placement import overlay_rect_on
from deskeye.settings import OverlaySettings

log = logging.getLogger(__name__)

WINDOW_TITLE = "DeskEye overlay"
THINKING_TEXT = N_("thinking…")      # words the user reads are translated where shown: _(THINKING_TEXT)
RELIFT_MS = 1000              # while shown: look whether a newly opened window covers it (deskeye/ui/stacking.py)
FADE_STEPS = 8
FADE_STEP_MS = 50
PAD_PX = 10                   # sizes in logical pixels: times the monitor's scale (deskeye/see/monitors.py)
MIN_HEIGHT_PX = 40
TK_SCALING_AT_96_DPI = 96 / 72   # Tk's `tk scaling` (pixels per point) at scale 1: font sizes follow the monitor
FONT_FAMILY = "DejaVu Sans"
MIN_FONT_POINTS = 7           # the heading and key objects are a little smaller than the answer, down to this
MAX_SUMMARY_CHARS = 1000      # what the window shows at most (answers are 200; notices and errors a few lines)
MAX_KEY_OBJECTS = 16
MAX_OBJECT_CHARS = 80
ELLIPSIS = "…"


class Kind(enum.StrEnum):
    ANSWER = "answer"
    THINKING = "thinking"
    ERROR = "error"
    NOTICE = "notice"
    FIRST_LOOK = "first_look"    # the OCR engine's answer, shown while a vision model answers (deskeye/ask/first_look.py)


COLOURS = {Kind.ANSWER: "#1f2430", Kind.THINKING: "#27304a", Kind.ERROR: "#5a1f24", Kind.NOTICE: "#3a3a3a",
           Kind.FIRST_LOOK: "#24343a"}
HEADINGS = {Kind.ANSWER: "DeskEye", Kind.THINKING: N_("DeskEye · thinking…"), Kind.ERROR: N_("DeskEye · error"),
            Kind.NOTICE: "DeskEye", Kind.FIRST_LOOK: N_("DeskEye · first look (OCR) · the model is answering…")}
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


def label_styles(settings: OverlaySettings, monitor: Monitor) -> dict[str, dict]:
    """The labels' fonts (points: Tk scales them to the monitor) and wrapping, from the overlay settings: at start, and
    again when they change while DeskEye runs."""
    wrap_px = monitor.px(settings.width_px - 2 * PAD_PX)
    return {"heading": {"font": (FONT_FAMILY, max(settings.font_size - 2, MIN_FONT_POINTS))},
            "summary": {"font": (FONT_FAMILY, settings.font_size), "wraplength": wrap_px},
            "objects": {"font": (FONT_FAMILY, max(settings.font_size - 1, MIN_FONT_POINTS)), "wraplength": wrap_px}}


class Overlay:
    def __init__(self, settings: OverlaySettings, monitor: Rect | None = None, *,
                 on_shown: Callable[[OverlayContent | None], None] = lambda content: None,
                 menu_actions: MenuActions | None = None, own_windows: OwnWindows | None = None,
                 on_own_window: Callable[[bool], None] = lambda is_open: None):
        self.settings = settings
        self.monitor = monitor                 # None = the whole X screen
        self.on_shown = on_shown               # called on the Tk thread with what is now shown (None = hidden)
        self.menu_actions = menu_actions       # None = no right-click menu
        self.own_windows = own_windows or OwnWindows()   # our windows: masked out of frames, never covered
        self.on_own_window = on_own_window     # called on the Tk thread: the Ask box or the menu opened / closed
        self._commands = TkCommands()
        self._stacking = OverlayStacking(self.own_windows)
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
        self._commands.stop()
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

    def apply(self, settings: OverlaySettings) -> None:
        """New overlay settings while running (deskeye/live_settings.py): the text shown now is restyled and placed
        again, and the next one is drawn with them (font, width, opacity, corner, margin, fade)."""
        self._post(lambda: self._apply(settings))

    def open_ask_dialog(self, on_submit: Callable[[str], None]) -> None:
        """The Ask box near the overlay; Enter calls `on_submit(question)` on the Tk thread (it must only
        enqueue), Esc closes it."""
        self._post(lambda: self._tk["ask_box"].open(self.settings, on_submit))

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
            self._commands.post(fn)

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
        self._commands.attach(root, on_stop=root.destroy)
        try:
            root.mainloop()
        finally:
            self._commands.detach()
            self._stacking.close()
            self._tk.clear()           # Tk objects must die on the thread that made them:
            del root                   # drop every reference, then collect the widget cycles here
            gc.collect()
            self._set_shown(None)

    def _build(self) -> None:
        import tkinter as tk
        root = tk.Tk(className="DeskEye")
        root.withdraw()
        monitor = self._layout(root)
        root.tk.call("tk", "scaling", monitor.scale * TK_SCALING_AT_96_DPI)
        window = tk.Toplevel(root, takefocus=0, class_="DeskEye")
        window.withdraw()
        window.title(WINDOW_TITLE)
        window.overrideredirect(True)
        window.attributes("-topmost", True)
        window.attributes("-alpha", self.settings.alpha)
        frame = tk.Frame(window, padx=monitor.px(PAD_PX), pady=monitor.px(PAD_PX), takefocus=0)
        frame.pack(fill="both", expand=True)
        styles = label_styles(self.settings, monitor)
        heading = tk.Label(frame, anchor="w", justify="left", fg="#9fb3d9", takefocus=0, **styles["heading"])
        summary = tk.Label(frame, anchor="w", justify="left", fg="white", takefocus=0, **styles["summary"])
        objects = tk.Label(frame, anchor="w", justify="left", fg="#d6c98a", takefocus=0, **styles["objects"])
        for label in (heading, summary, objects):
            label.pack(fill="x", anchor="w")
        for widget in (window, frame, heading, summary, objects):
            widget.bind("<Button-3>", lambda event: self._popup_menu(event.x_root, event.y_root))
        # Mapped, it is on top of every window, DeskEye's own menus too: so under those at once.
        window.bind("<Map>", lambda event: event.widget is window and self._keep_on_top())
        window.update_idletasks()
        self._register(window)
        ask_box = AskBox(root, read_monitor=self._layout, overlay_height_px=self._height_on,
                         register=self._register, unregister=self._unregister, keep_overlay_under=self._keep_on_top,
                         on_open_changed=self._own_window)
        self._tk = {"tk": tk, "root": root, "window": window, "frame": frame, "heading": heading,
                    "summary": summary, "objects": objects, "ask_box": ask_box}

    def _register(self, widget) -> tuple[int, ...]:
        """Mark a Tk window as DeskEye's own, by its X window and its top level (Tk's wrapper, or the window manager's
        frame once it has one): capture masks it out, the overlay never covers it. Returns the ids registered."""
        inner = int(widget.winfo_id())
        ids = tuple(dict.fromkeys((inner, self._stacking.top_level(inner))))
        for window_id in ids:
            self.own_windows.register(window_id)
        return ids

    def _unregister(self, ids: tuple[int, ...]) -> None:
        for window_id in ids:
            self.own_windows.unregister(window_id)

    def _own_window(self, is_open: bool) -> None:
        try:
            self.on_own_window(is_open)
        except Exception:
            log.exception("overlay on_own_window callback failed")

    def _apply(self, settings: OverlaySettings) -> None:
        self.settings = settings
        window = self._tk["window"]
        for name, style in label_styles(settings, self._layout(window)).items():
            self._tk[name].configure(**style)
        if window.winfo_ismapped():
            window.attributes("-alpha", settings.alpha)
            self._place(window)

    def _render(self, content: OverlayContent) -> None:
        tk = self._tk
        colour = COLOURS.get(content.kind, COLOURS["notice"])
        for name in ("window", "frame", "heading", "summary", "objects"):
            tk[name].configure(bg=colour)
        tk["heading"].configure(text=_(HEADINGS.get(content.kind, "DeskEye")))
        tk["summary"].configure(text=content.summary)
        tk["objects"].configure(text="   ".join(f"• {o}" for o in content.key_objects))
        window = tk["window"]
        window.attributes("-alpha", self.settings.alpha)
        self._place(window)
        window.deiconify()                 # (already shown: nothing; newly shown: <Map> keeps it under our menus)
        self._schedule_fade(content.kind)
        self._schedule_relift()
        objects_text = tk["objects"].cget("text")
        shown_objects = tuple(o[2:] for o in objects_text.split("   ")) if objects_text else ()
        self._set_shown(OverlayContent(content.kind, tk["summary"].cget("text"), shown_objects))

    def _layout(self, widget) -> Monitor:
        """The monitor with its scale and its work area (the panels on it), read now: panels come and go."""
        from deskeye.see.monitors import read_monitor
        return read_monitor(self.monitor or Rect(0, 0, widget.winfo_screenwidth(), widget.winfo_screenheight()))

    def _place(self, window) -> None:
        window.update_idletasks()
        monitor = self._layout(window)
        height = max(self._tk["frame"].winfo_reqheight(), monitor.px(MIN_HEIGHT_PX))
        rect = overlay_rect_on(monitor, self.settings, height)
        window.geometry(f"{rect.width}x{rect.height}+{rect.left}+{rect.top}")
        self._tk["height"] = rect.height
        own_windows_changed()              # (its text changed too) on Wayland, grabs wait until frames show it

    def _height_on(self, monitor: Monitor) -> int:
        """The overlay's height as last placed (the Ask box goes beside it), or its least before it was shown."""
        return self._tk.get("height", monitor.px(MIN_HEIGHT_PX))

    def _schedule_relift(self) -> None:
        window = self._tk["window"]
        if self._tk.get("relift_job"):
            window.after_cancel(self._tk["relift_job"])

        def relift():
            if window.winfo_ismapped():
                self._keep_on_top()
                self._tk["relift_job"] = window.after(RELIFT_MS, relift)

        self._tk["relift_job"] = window.after(RELIFT_MS, relift)

    def _keep_on_top(self) -> None:
        """Above other programs' windows, below DeskEye's own menus and Ask box (deskeye/ui/stacking.py)."""
        if not self._tk["window"].winfo_ismapped():
            return
        if self._tk.get("window_id") is None:        # mapped for the first time: its top level is known now
            self._tk["window_id"] = self._register(self._tk["window"])[-1]
        self._stacking.apply(self._tk["window_id"])

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
        own_windows_changed()
        self._set_shown(None)

    def _popup_menu(self, x_root: int, y_root: int) -> None:
        """DeskEye's menu at the pointer (right-click on the overlay); Tk thread only."""
        if self.menu_actions is None:
            return
        tk = self._tk["tk"]
        old = self._tk.get("menu")
        if old is not None:
            self._unregister(self._tk.pop("menu_ids"))
            self._menu_posted(False)
            old.destroy()
        menu = tk.Menu(self._tk["root"], tearoff=0)
        for entry in menu_entries(self.menu_actions):
            menu.add_command(label=entry.label, command=lambda action=entry.action: self._run_action(action))
        self._tk["menu"] = menu
        menu.bind("<Map>", lambda event: self._menu_posted(True))
        menu.bind("<Unmap>", lambda event: self._menu_posted(False))
        menu.update_idletasks()
        self._tk["menu_ids"] = self._register(menu)
        menu.tk_popup(x_root, y_root)      # on X11 it returns at once; its grab closes it on a click elsewhere

    def _menu_posted(self, is_posted: bool) -> None:
        if self._tk.get("menu_posted", False) != is_posted:
            self._tk["menu_posted"] = is_posted
            self._own_window(is_posted)

    @staticmethod
    def _run_action(action: Callable[[], None]) -> None:
        try:
            action()
        except Exception:
            log.exception("menu action failed")
