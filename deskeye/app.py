"""The desktop app: capture -> (privacy, change) -> job queue -> route -> worker -> overlay/hooks.

`build_app(settings)` (deskeye/compose.py) builds every part from the settings; `App` only runs what it was given.

Threads, each stoppable:
- capture loop: every `capture.interval_s`, unless paused, DeskEye's own Ask box or menu is open (or just closed),
  or an excluded window is active or in the region, grab the region (DeskEye's own windows masked out); if it
  changed meaningfully since the last described frame (deskeye/see/change.py), queue an automatic describe;
- job thread: serves describe/ask jobs one at a time, in order (hotkey and tray jobs first, none dropped);
- hotkeys (pynput), the `deskeye trigger` socket (`deskeye run` only), tray (GTK, daemon) and the overlay's Tk
  thread: they only enqueue or display;
- settings watcher (deskeye/live_settings.py): a change of the settings file is applied to the parts that can take it
  (`apply_settings`, one `apply` per part) and the user is told what needs a restart.
What a job does, from frame to answer (deskeye/answering.py): every description is shown in the overlay and goes to
the screen memory ("what was that?") and the hooks; what the user asked for is also kept in the rolling conversation
memory (cleared on pause/quit).

A quit is for good, whenever it comes: `start()` checks for it between its steps and `quit()` waits for the step
in progress, so nothing is started after it. `deskeye run` (deskeye/run.py) handles SIGTERM/SIGINT from its first
line, keeps its temporary files in one run folder and ends cleanly when the X server goes away.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from deskeye.answering import Answering
from deskeye.errors import DeskEyeError, SettingsError
from deskeye.hotkey_syntax import display_name
from deskeye.jobs import ASK, AUTO, DESCRIBE, HOTKEY, TRAY, Job
from deskeye.language import _
from deskeye.live_settings import SettingsUpdate, SettingsWatcher
from deskeye.parts import AppParts
from deskeye.see.capture import check_display
from deskeye.see.geometry import Rect
from deskeye.settings import Settings
from deskeye.ui.hotkey_route import HotkeyRoute, Route, hotkey_route
from deskeye.ui.portal_shortcuts import PortalShortcuts
from deskeye.ui.hotkeys import Hotkeys
from deskeye.ui.overlay import Kind, Overlay, OverlayContent
from deskeye.ui.speech import Speaker
from deskeye.ui.tray import BUSY, IDLE, PAUSED, WORKER_DOWN, Tray, TrayActions, open_settings_file
from deskeye.ui.trigger import TriggerListener

log = logging.getLogger(__name__)

JOB_POLL_S = 0.5                 # how often an idle job thread checks for quit
JOIN_TIMEOUT_S = 10.0


class App:
    """Runs the parts `build_app` made: starts them, serves the job queue, and stops them all on quit."""

    def __init__(self, settings: Settings, parts: AppParts, *, settings_path: Path,
                 live_settings: SettingsWatcher | None = None):
        self.settings = settings
        self.settings_path = settings_path
        self.live_settings = live_settings       # None: a change of the settings file waits for a restart
        self.parts = parts
        self.own_windows, self.grabber, self.change = parts.own_windows, parts.grabber, parts.change
        self.jobs, self.memory, self.screen_memory = parts.jobs, parts.memory, parts.screen_memory
        self.supervisor, self.client, self.first_look = parts.supervisor, parts.client, parts.first_look
        self.overlay: Overlay | None = None       # made when the app starts, with its actions
        self.tray: Tray | None = None
        self.hotkeys: Hotkeys | PortalShortcuts | None = None
        self.trigger: TriggerListener | None = None      # `deskeye trigger` (deskeye/ui/trigger.py)
        self.hotkey_route: HotkeyRoute | None = None     # how the user's keys reach the app: said once at start
        self.answering = Answering(settings, parts, show=self._show, is_paused=lambda: self.is_paused)
        self.speaker = Speaker.for_settings(settings, on_unavailable=lambda message: self._show(Kind.NOTICE, message))
        self._paused = threading.Event()
        self._busy = threading.Event()
        self._stop = threading.Event()      # quit asked for: set once, never cleared
        self._closed = threading.Event()
        self._wake_capture = threading.Event()   # the capture loop's wait is cut short: quit, or a new interval
        self._quit_lock = threading.Lock()
        self._start_lock = threading.Lock()  # held while start() runs; the shutdown waits for it
        self._threads: list[threading.Thread] = []
        self._capture_error = ""            # the capture loop's last error, shown once until a grab works again

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start every part; if one cannot start, stop what did and raise its error. After (or during) `quit()`
        it stops at the next step: nothing is started once a quit was asked for."""
        try:
            with self._start_lock:
                if self._stop.is_set():
                    return
                self._privacy_notice = self.parts.window_list.say_titles_unknown(self.settings.excluded_titles)
                check_display()
                for step in (self._start_overlay, self._start_worker_and_loops, self._start_hotkeys,
                             self._start_trigger, self._start_tray, self._start_live_settings):
                    if self._stop.is_set():
                        return
                    step()
                self._refresh_state()
        except BaseException:
            self.quit()
            self.wait(JOIN_TIMEOUT_S * 2)
            raise

    def _start_overlay(self) -> None:
        self.supervisor.on_state_change = lambda state: self._refresh_state()
        self.overlay = self.parts.make_overlay(self._overlay_area(), self.tray_actions())
        self.overlay.start()
        if self._privacy_notice:
            self._show(Kind.NOTICE, self._privacy_notice)

    def _start_worker_and_loops(self) -> None:
        self.supervisor.start(wait=False)
        if self.first_look is not None:
            self.first_look.start()
        self._spawn("deskeye-jobs", self._job_loop)
        self._spawn("deskeye-capture", self._capture_loop)

    def _start_hotkeys(self) -> None:
        if self.parts.make_hotkeys is None:
            return
        self.hotkeys = self.parts.make_hotkeys(on_describe=lambda: self.describe_now(HOTKEY),
                                               on_pause=self.toggle_pause, on_ask=self.open_ask)
        try:
            self.hotkeys.start()
        except SettingsError:
            raise
        except DeskEyeError as exc:       # the tray still works: say so and carry on
            log.warning("%s", exc)
            self.hotkeys = None
            self._show(Kind.ERROR, str(exc))

    def _start_trigger(self) -> None:
        """The trigger socket, then the keys' route; where it is that command, the overlay tells how to bind it."""
        if self.parts.make_trigger is not None:
            trigger = self.parts.make_trigger(self.tray_actions())
            try:
                trigger.start()
                self.trigger = trigger
            except DeskEyeError as exc:       # the hotkeys and the tray still work: say so and carry on
                log.warning("%s", exc)
                self._show(Kind.ERROR, str(exc))
        bound = self.hotkeys.bound if isinstance(self.hotkeys, PortalShortcuts) else None
        self.hotkey_route = hotkey_route(self.settings.hotkeys, hotkeys_running=self.hotkeys is not None,
                                         portal_bound=bound)
        if self.trigger is not None and self.hotkey_route.route == Route.TRIGGER_COMMAND:
            self._show(Kind.NOTICE, "\n\n".join(filter(None, (self._privacy_notice, self.hotkey_route.message))))

    def _start_tray(self) -> None:
        if self.parts.make_tray is not None:
            self.tray = self.parts.make_tray(self.tray_actions())
            self.tray.start(cancel=self._stop)

    def _start_live_settings(self) -> None:
        if self.live_settings is not None:
            self.live_settings.start(self._settings_changed)

    def _overlay_area(self) -> Rect:
        """The watched monitor (the overlay goes to its corner); checks the region lies on it."""
        try:
            return self.grabber.overlay_monitor()
        finally:
            self.grabber.close_thread()

    def _spawn(self, name: str, target) -> None:
        thread = threading.Thread(target=target, name=name)
        self._threads.append(thread)
        thread.start()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the app has quit (True) or `timeout_s` passed (False)."""
        return self._closed.wait(timeout_s)

    @property
    def is_stopping(self) -> bool:
        """A quit was asked for (it may still be in progress)."""
        return self._stop.is_set()

    def stuck_threads(self) -> list[str]:
        """After quit: the app's threads that did not end (e.g. blocked on a frozen X server)."""
        stuck = [thread.name for thread in self._threads if thread.is_alive()]
        if self.overlay is not None and self.overlay.is_running:
            stuck.append("deskeye-overlay")
        return stuck

    def ready_line(self) -> str:
        """What `deskeye run` says once started: the region, how to quit, and how the user's keys reach the app."""
        rect = self.grabber.rect()
        self.grabber.close_thread()
        route = f"\ndeskeye: {self.hotkey_route.message}" if self.hotkey_route is not None else ""
        return (f"deskeye: watching {rect.width}x{rect.height} at {rect.left},{rect.top} "
                f"(monitor {self.settings.capture.monitor}); quit from the tray or with Ctrl+C.{route}")

    @property
    def is_paused(self) -> bool:
        return self._paused.is_set()

    # ------------------------------------------------------------------ actions (tray, hotkeys, tests)

    def tray_actions(self) -> TrayActions:
        return TrayActions(describe_now=lambda: self.describe_now(TRAY), ask=self.open_ask,
                           toggle_pause=self.toggle_pause, open_settings=self.open_settings,
                           quit=self.quit, is_paused=lambda: self.is_paused)

    def describe_now(self, source: str = HOTKEY) -> None:
        self.jobs.put(Job(DESCRIBE, source))

    def ask(self, question: str, source: str = TRAY) -> None:
        question = question.strip()
        if question:
            self.jobs.put(Job(ASK, source, question=question))

    def open_ask(self) -> None:
        if self.overlay is not None:
            self.overlay.open_ask_dialog(self.ask)

    def toggle_pause(self) -> None:
        self.resume() if self.is_paused else self.pause()

    def pause(self) -> None:
        self._paused.set()
        self._forget()
        self._show(Kind.NOTICE, _("Paused: DeskEye is not looking. Resume from the tray or press {key}.").format(
            key=display_name(self.settings.hotkeys.pause)))
        self._refresh_state()

    def _forget(self) -> None:
        """Privacy: drop what DeskEye remembers of the screen and the conversation."""
        self.memory.clear()
        self.screen_memory.clear()

    def resume(self) -> None:
        self._paused.clear()
        self.change.reset()             # describe the screen as it is now
        self._show(Kind.NOTICE, _("Watching again."))
        self._refresh_state()

    def open_settings(self) -> None:
        try:
            open_settings_file(self.settings_path)
        except (DeskEyeError, OSError) as exc:
            self._show(Kind.ERROR, str(exc))

    def apply_settings(self, settings: Settings) -> None:
        """Settings changed while running, in the keys that can change live (deskeye/live_settings.py decides which):
        each part takes its section through its `apply`; the capture loop wakes to wait the new interval."""
        self.settings = self.answering.settings = settings     # excluded windows, debug frames, the interval
        self.grabber.apply(settings.capture, settings.overlay)
        self.change.apply(settings.capture)
        if self.overlay is not None:
            self.overlay.apply(settings.overlay)
        self.speaker.enabled = settings.overlay.speak
        self._wake_capture.set()

    def _settings_changed(self, update: SettingsUpdate) -> None:
        """The settings file changed (on the watcher's thread): apply what can be, tell the user once."""
        if update.applied:
            self.apply_settings(update.in_effect)
        message = update.message
        if message:
            log.log(logging.WARNING if update.error or update.newly_pending else logging.INFO, "%s", message)
            self._show(Kind.ERROR if update.error else Kind.NOTICE, message)

    def quit(self) -> None:
        """Stop everything (on a separate thread, so any thread may call it); `wait()` returns when done."""
        with self._quit_lock:
            if self._stop.is_set():
                return
            self._stop.set()
            self._wake_capture.set()
        threading.Thread(target=self._shutdown, name="deskeye-quit").start()

    def _shutdown(self) -> None:
        """Each part stops even when one before it fails (e.g. on a display that went away)."""
        try:
            with self._start_lock:          # start() returns at its next step: no part starts after this
                pass
            for name, stop in (("settings watcher", self._stopper("live_settings")),
                               ("speech", self.speaker.stop), ("hotkeys", self._stopper("hotkeys")),
                               ("trigger", self._stopper("trigger")), ("tray", self._stopper("tray")),
                               ("job queue", self.jobs.put_stop), ("worker", self.stop_workers),
                               ("threads", self._join_threads), ("jobs", self.jobs.drain),
                               ("client and hooks", self._close_parts), ("memory", self._forget),
                               ("overlay", self._stopper("overlay"))):
                try:
                    stop()
                except Exception:
                    log.exception("stopping the %s failed; stopping the rest", name)
        finally:
            self._closed.set()

    def _stopper(self, attribute: str):
        """Stops the part held in `attribute` at stop time, if it was made (None: it never started)."""
        def stop() -> None:
            part = getattr(self, attribute)
            if part is not None:
                part.stop()
        return stop

    def stop_workers(self) -> None:
        """The model's worker and the first look's: an in-flight request fails fast instead of running on."""
        self.supervisor.stop()
        if self.first_look is not None:
            self.first_look.stop()

    def _join_threads(self) -> None:
        for thread in self._threads:
            thread.join(JOIN_TIMEOUT_S)

    def _close_parts(self) -> None:
        self.client.close()
        self.parts.hooks.close()

    # ------------------------------------------------------------------ capture loop

    def _capture_loop(self) -> None:
        try:
            while self._wait_for_tick():
                if not self.is_paused:
                    self._capture_tick()
        finally:
            self.grabber.close_thread()
            self.own_windows.close_thread()

    def _wait_for_tick(self) -> bool:
        """Wait `capture.interval_s`, read again when the settings change while waiting; False: quit."""
        started = time.monotonic()
        while not self._stop.is_set():
            left = started + self.settings.capture.interval_s - time.monotonic()
            if left <= 0:
                return True
            self._wake_capture.wait(left)
            self._wake_capture.clear()
        return False

    def _capture_tick(self) -> None:
        if self.change.is_held:             # DeskEye's Ask box or menu is open: what it repaints is no change
            return
        try:
            seen = self.parts.window_list.read()             # read once a tick: for privacy and for the masks
            if (verdict := self.answering.privacy(seen)).is_excluded:
                log.debug("not capturing: %s", verdict.reason)
                return
            frame = self.grabber.grab(with_windows=False,    # most frames are not described: no window facts
                                      own=[w.rect for w in seen.windows if w.is_own])
        except DeskEyeError as exc:
            if str(exc) != self._capture_error:     # said once (e.g. a black grab: its cause and fix), then retried
                self._capture_error = str(exc)
                log.warning("capture failed: %s", exc)
                self._show(Kind.ERROR, str(exc))
            return
        self._capture_error = ""
        if self.change.should_describe(frame.image, frame.masks):
            self.change.mark_described(frame.image, frame.masks)
            self.jobs.put(Job(DESCRIBE, AUTO, frame=frame.with_window_facts()))

    # ------------------------------------------------------------------ job thread

    def _job_loop(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    job = self.jobs.get(JOB_POLL_S)
                except StopIteration:
                    return
                if job is not None:
                    self._serve(job)
        finally:
            self.grabber.close_thread()
            self.own_windows.close_thread()

    def _serve(self, job: Job) -> None:
        self._busy.set()
        self._refresh_state()
        try:
            self.answering.serve(job)
        finally:
            self._busy.clear()
            self._refresh_state()

    # ------------------------------------------------------------------ display

    def _show(self, kind: Kind, text: str = "", key_objects=()) -> None:
        if self.overlay is not None:
            self.overlay.show(OverlayContent(kind, text, tuple(key_objects)))
        if kind == Kind.ANSWER:
            self.speaker.say(text)           # overlay.speak: read aloud, interrupting the previous answer

    def _refresh_state(self) -> None:
        if self.tray is None:
            return
        worker_state = self.supervisor.state
        if self.is_paused:
            state = PAUSED
        elif worker_state in ("down", "unresponsive"):
            state = WORKER_DOWN
        elif self._busy.is_set():
            state = BUSY
        else:
            state = IDLE
        if state != self.tray.state:
            self.tray.set_state(state)
