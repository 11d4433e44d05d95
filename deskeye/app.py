"""`deskeye run`: the desktop app. Capture -> (privacy, change) -> job queue -> route -> worker -> overlay/hooks.

`build_app(settings)` builds every part from the settings; `App` only runs them.

Threads, each stoppable:
- capture loop: every `capture.interval_s`, unless paused or an excluded window is active or in the
  region, grab the region (DeskEye's own windows masked out); if it changed meaningfully since the last
  described frame (deskeye/change.py), queue an automatic describe;
- job thread: serves describe/ask jobs one at a time, in order (hotkey and tray jobs first, none dropped);
- hotkeys (pynput), tray (GTK, daemon) and the overlay's Tk thread: they only enqueue or display.
Every description is shown in the overlay and goes to the screen memory ("what was that?") and the hooks;
what the user asked for is also kept in the rolling conversation memory (cleared on pause/quit).
With a vision model, a describe is answered in two stages (deskeye/first_look.py): a local OCR worker's first
look is shown at once, then the model's answer replaces it; only the model's answer is remembered and fires hooks.

A quit is for good, whenever it comes: `start()` checks for it between its steps and `quit()` waits for the step
in progress, so nothing is started after it. `deskeye run` (cmd_run) handles SIGTERM/SIGINT from its first line,
keeps its temporary files in one run folder and ends cleanly when the X server goes away (deskeye/lifecycle.py).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path

from deskeye.asking import route_question
from deskeye.capture import Frame, ScreenGrabber, check_display
from deskeye.change import ChangeDetector
from deskeye.errors import DeskEyeError, SettingsError, UsageError
from deskeye.first_look import (FIRST_LOOK_LABEL, MAX_HEAD_START_S, MAX_WAIT_AFTER_MODEL_FAILED_S, FirstLookPart,
                                Stages, model_shares_this_cpu)
from deskeye.geometry import Rect
from deskeye.jobs import ASK, AUTO, DESCRIBE, HOTKEY, TRAY, Job, JobQueue
from deskeye.lifecycle import EXIT_STUCK, RunFolder, StopSignals, exit_now, on_display_lost, write_stderr
from deskeye.memory import ConversationMemory
from deskeye.overlay import Kind, Overlay, OverlayContent
from deskeye.placement import overlay_column
from deskeye.privacy import PrivacyVerdict, check_privacy
from deskeye.prompt import DESCRIBE_QUESTION, Description
from deskeye.settings import Settings, default_settings_path, with_overrides
from deskeye.tray import BUSY, IDLE, PAUSED, WORKER_DOWN, Tray, TrayActions, open_settings_file
from deskeye.x11_windows import OwnWindows

log = logging.getLogger(__name__)

JOB_POLL_S = 0.5                 # how often an idle job thread checks for quit
JOIN_TIMEOUT_S = 10.0
DISPLAY_LOST_WAIT_S = 2.0        # the X server went away: this long for the rest of a clean stop (the threads that
                                 # draw are stuck on the dead display; the worker is stopped before)
DEEP_MAX_TOKENS_FACTOR = 4       # a deep question may answer at length: this many times worker.max_tokens
MAX_REQUEST_TOKENS = 1024        # the worker's default --max-tokens-limit


class App:
    def __init__(self, settings: Settings, *, region: str | None = None, supervisor=None, client=None,
                 router=None, quick=None, screen_memory=None, notifier=None, hooks=None,
                 first_look: FirstLookPart | None = None, use_tray: bool = True, use_hotkeys: bool = True,
                 settings_path: Path | None = None, temp_root: Path | None = None):
        self.settings = settings
        self.settings_path = settings_path or settings.config_dir / "settings.toml"
        self.own_windows = OwnWindows()
        self.grabber = ScreenGrabber(settings.capture, region, avoid=self._overlay_column,
                                     mask=self.own_windows.own_rects)
        capture = settings.capture
        self.change = ChangeDetector(capture.change_threshold, capture.min_changed_percent,
                                     capture.small_change_interval_s)
        self.memory = ConversationMemory(settings.memory.turns)
        self.jobs = JobQueue()
        self.supervisor, self.client = supervisor, client
        self.router, self.quick, self.screen_memory = router, quick, screen_memory
        self.notifier, self.hooks = notifier, hooks
        self.first_look = first_look        # None: one stage (the OCR engine alone, or worker.ocr_first = false)
        self.overlay: Overlay | None = None
        self.tray: Tray | None = (Tray(self.tray_actions(), ask_hotkey=settings.hotkeys.ask, temp_root=temp_root)
                                  if use_tray else None)
        self.hotkeys = None
        self._use_hotkeys = use_hotkeys
        self._paused = threading.Event()
        self._busy = threading.Event()
        self._stop = threading.Event()      # quit asked for: set once, never cleared
        self._closed = threading.Event()
        self._quit_lock = threading.Lock()
        self._start_lock = threading.Lock()  # held while start() runs; the shutdown waits for it
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start every part; if one cannot start, stop what did and raise its error. After (or during) `quit()`
        it stops at the next step: nothing is started once a quit was asked for."""
        try:
            with self._start_lock:
                if self._stop.is_set():
                    return
                check_display()
                self._check_parts()
                for step in (self._start_overlay, self._start_worker_and_loops, self._start_hotkeys,
                             self._start_tray):
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
        self.overlay = Overlay(self.settings.overlay, self._overlay_area(), menu_actions=self.tray_actions(),
                               own_windows=self.own_windows)
        self.overlay.start()

    def _start_worker_and_loops(self) -> None:
        self.supervisor.start(wait=False)
        if self.first_look is not None:
            self.first_look.start()
        self._spawn("deskeye-jobs", self._job_loop)
        self._spawn("deskeye-capture", self._capture_loop)

    def _start_hotkeys(self) -> None:
        if not self._use_hotkeys:
            return
        from deskeye.hotkeys import Hotkeys
        self.hotkeys = Hotkeys(self.settings.hotkeys, on_describe=lambda: self.describe_now(HOTKEY),
                               on_pause=self.toggle_pause, on_ask=self.open_ask)
        try:
            self.hotkeys.start()
        except SettingsError:
            raise
        except DeskEyeError as exc:       # the tray still works: say so and carry on
            log.warning("%s", exc)
            self.hotkeys = None
            self._show(Kind.ERROR, str(exc))

    def _start_tray(self) -> None:
        if self.tray is not None:
            self.tray.start(cancel=self._stop)

    def _check_parts(self) -> None:
        missing = [name for name in ("supervisor", "client", "quick", "screen_memory", "notifier", "hooks")
                   if getattr(self, name) is None]
        if missing:
            raise TypeError(f"App needs {', '.join(missing)}: build it with build_app(settings).")

    def _overlay_column(self, monitor: Rect) -> Rect:
        """The strip of the monitor the overlay and the Ask box use: kept out of the default region."""
        o = self.settings.overlay
        return overlay_column(monitor, o.width_px, o.margin_px, o.position)

    def _overlay_area(self):
        """The watched monitor (the overlay goes to its top-right); checks the region lies on it."""
        try:
            self.grabber.rect()
            return self.grabber.monitor()
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
        rect, hotkeys = self.grabber.rect(), self.settings.hotkeys
        self.grabber.close_thread()
        keys = (f"describe {hotkeys.describe}, ask {hotkeys.ask}, pause {hotkeys.pause}" if self.hotkeys
                else "hotkeys off")
        return (f"deskeye: watching {rect.width}x{rect.height} at {rect.left},{rect.top} "
                f"(monitor {self.settings.capture.monitor}); {keys}; quit from the tray or with Ctrl+C.")

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
        self._show(Kind.NOTICE, f"Paused: DeskEye is not looking. Resume from the tray or press "
                                f"{self.settings.hotkeys.pause}.")
        self._refresh_state()

    def _forget(self) -> None:
        """Privacy: drop what DeskEye remembers of the screen and the conversation."""
        self.memory.clear()
        if self.screen_memory is not None:
            self.screen_memory.clear()

    def resume(self) -> None:
        self._paused.clear()
        self.change.reset()             # describe the screen as it is now
        self._show(Kind.NOTICE, "Watching again.")
        self._refresh_state()

    def open_settings(self) -> None:
        try:
            open_settings_file(self.settings_path)
        except (DeskEyeError, OSError) as exc:
            self._show(Kind.ERROR, str(exc))

    def quit(self) -> None:
        """Stop everything (on a separate thread, so any thread may call it); `wait()` returns when done."""
        with self._quit_lock:
            if self._stop.is_set():
                return
            self._stop.set()
        threading.Thread(target=self._shutdown, name="deskeye-quit").start()

    def _shutdown(self) -> None:
        """Each part stops even when one before it fails (e.g. on a display that went away)."""
        try:
            with self._start_lock:          # start() returns at its next step: no part starts after this
                pass
            for name, stop in (("hotkeys", self._stop_hotkeys), ("tray", self._stop_tray),
                               ("job queue", self.jobs.put_stop), ("worker", self._stop_worker),
                               ("threads", self._join_threads), ("jobs", self.jobs.drain),
                               ("client and hooks", self._close_parts), ("memory", self._forget),
                               ("overlay", self._stop_overlay)):
                try:
                    stop()
                except Exception:
                    log.exception("stopping the %s failed; stopping the rest", name)
        finally:
            self._closed.set()

    def _stop_hotkeys(self) -> None:
        if self.hotkeys is not None:
            self.hotkeys.stop()

    def _stop_tray(self) -> None:
        if self.tray is not None:
            self.tray.stop()

    def _stop_worker(self) -> None:
        self.stop_workers()

    def stop_workers(self) -> None:
        """The model's worker and the first look's: an in-flight request fails fast instead of running on."""
        if self.supervisor is not None:
            self.supervisor.stop()
        if self.first_look is not None:
            self.first_look.stop()

    def _join_threads(self) -> None:
        for thread in self._threads:
            thread.join(JOIN_TIMEOUT_S)

    def _close_parts(self) -> None:
        for part in (self.client, self.hooks):
            if part is not None and hasattr(part, "close"):
                part.close()

    def _stop_overlay(self) -> None:
        if self.overlay is not None:
            self.overlay.stop()

    # ------------------------------------------------------------------ capture loop

    def _capture_loop(self) -> None:
        try:
            while not self._stop.wait(self.settings.capture.interval_s):
                if not self.is_paused:
                    self._capture_tick()
        finally:
            self.grabber.close_thread()
            self.own_windows.close_thread()

    def _capture_tick(self) -> None:
        try:
            verdict = self._privacy()
            if verdict.is_excluded:
                log.debug("not capturing: %s", verdict.reason)
                return
            frame = self.grabber.grab()
        except DeskEyeError as exc:
            log.warning("capture failed: %s", exc)
            return
        if self.change.should_describe(frame.image, frame.masks):
            self.change.mark_described(frame.image, frame.masks)
            self.jobs.put(Job(DESCRIBE, AUTO, frame=frame))

    def _privacy(self) -> PrivacyVerdict:
        return check_privacy(self.settings.excluded_titles, region=self.grabber.rect(),
                             windows=self.own_windows.windows())

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
            if job.kind == DESCRIBE:
                self._describe(job)
            else:
                self._ask(job)
        except DeskEyeError as exc:
            self._fail(job, str(exc))
        except Exception as exc:            # a bug must not end the job thread: show it, keep serving
            log.exception("job %s failed", job)
            self._fail(job, f"Internal error: {exc}")
        finally:
            self._busy.clear()
            self._refresh_state()

    def _fail(self, job: Job, message: str) -> None:
        if job.is_user:
            self._show(Kind.ERROR, message)
        else:
            log.warning("automatic describe failed: %s", message)
            self.change.reset()              # try again on the next tick

    def _describe(self, job: Job) -> None:
        if self.is_paused and not job.is_user:
            return                           # queued before the pause: dropped
        frame = job.frame or self._user_frame()
        if frame is None:
            return
        png = self._png(frame)
        stages = self._first_look(png, frame)
        try:
            answer = self.client.ask(DESCRIBE_QUESTION, png, self.memory.turns(),
                                     on_text=self._stream if stages is None else stages.model_text,
                                     windows=frame.windows)
        except DeskEyeError as exc:
            if stages is None or not self._keep_first_look(job, stages, exc):
                raise
            return
        if stages is not None:
            stages.finish()                  # a first look still on its way is not shown over the answer
        self.change.mark_described(frame.image, frame.masks)
        self._remember(DESCRIBE_QUESTION if job.is_user else "", answer)
        self._show(Kind.ANSWER, answer.summary, answer.key_objects)   # a changed screen is shown too

    def _ask(self, job: Job) -> None:
        routed = route_question(job.question, self._router(), self.quick)
        if routed.quick_answer is not None:
            quick = routed.quick_answer
            self._show(Kind.ERROR if quick.is_error else Kind.ANSWER, quick.text)
            return
        deep = routed.tier == "deep"
        if deep:
            self._show(Kind.THINKING, "thinking…")
        frame = self._user_frame()
        if frame is None:
            return
        max_tokens = None
        if deep:
            max_tokens = min(self.settings.worker.max_tokens * DEEP_MAX_TOKENS_FACTOR, MAX_REQUEST_TOKENS)
        answer = self.client.ask(job.question, self._png(frame), self.memory.turns(), max_tokens=max_tokens,
                                 on_text=None if deep else self._stream, windows=frame.windows)
        self._remember(job.question, answer)
        self._show(Kind.ANSWER, answer.shown_text(), answer.key_objects)     # with a note if the question was cut
        if deep:
            self.notifier.notify("DeskEye", answer.shown_text())

    def _first_look(self, png: bytes, frame: Frame) -> Stages | None:
        """Two stages for this describe: the OCR worker reads the frame while the model answers. None: one stage
        (no first look configured, the model's worker is itself OCR, or the OCR worker is not serving)."""
        if self.first_look is None or not self.first_look.is_useful(self.supervisor):
            return None
        stages = Stages(self._show)
        if not self.first_look.ask(stages, png, frame.windows):
            return None
        if model_shares_this_cpu(self.settings.worker):
            stages.wait_for_first_look(MAX_HEAD_START_S)   # side by side on the same cores, both would be slow
        return stages

    def _keep_first_look(self, job: Job, stages: Stages, error: DeskEyeError) -> bool:
        """The model failed: show its error under the first look, which stays (False: there is no first look).
        Nothing is remembered and no hook fires: the first look is not a final answer."""
        first = stages.first_look_for_failure(MAX_WAIT_AFTER_MODEL_FAILED_S)
        if first is None:
            return False
        log.warning("the model did not answer (%s); the first look (OCR) stays on the overlay", error)
        self._show(Kind.ERROR, f"{FIRST_LOOK_LABEL}: {first.summary}\nThe model did not answer: {error}",
                   first.key_objects)
        if not job.is_user:
            self.change.reset()              # try the model again on the next tick
        return True

    def _stream(self, text_so_far: str) -> None:
        """A streamed answer's summary so far: the overlay grows with it (as "thinking" until the whole answer,
        with its key objects, is in)."""
        if text_so_far:
            self._show(Kind.THINKING, f"{text_so_far}…")

    def _router(self):
        if self.router is None:
            from deskeye.router import Router
            self.router = Router.load(self.settings)
        return self.router

    def _user_frame(self) -> Frame | None:
        """A fresh frame for a user's request, or None (shown why) when paused or an excluded window is active."""
        if self.is_paused:
            self._show(Kind.NOTICE, f"DeskEye is paused and not looking at the screen. Resume it from the tray "
                                    f"or press {self.settings.hotkeys.pause}.")
            return None
        verdict = self._privacy()
        if verdict.is_excluded:
            self._show(Kind.NOTICE, verdict.reason)
            return None
        return self.grabber.grab()

    def _png(self, frame: Frame) -> bytes:
        png = frame.png()
        folder = self.settings.capture.debug_save_frames_dir
        if folder:
            path = Path(folder).expanduser()
            path.mkdir(parents=True, exist_ok=True)
            (path / f"frame-{time.time_ns()}.png").write_bytes(png)
        return png

    def _remember(self, question: str, answer) -> None:
        """Screen memory and hooks get every description; the conversation memory what the user asked
        (`question`, "" for automatic ones). Nothing is kept if the user paused while it was on its way."""
        if self.is_paused:
            return
        description = Description(answer.summary, list(answer.key_objects))
        self.screen_memory.remember(description)
        if question:
            self.memory.add(question, answer.summary)
        if self.settings.hooks.enabled:
            self.hooks.fire(description)

    # ------------------------------------------------------------------ display

    def _show(self, kind: Kind, text: str = "", key_objects=()) -> None:
        if self.overlay is not None:
            self.overlay.show(OverlayContent(kind, text, tuple(key_objects)))

    def _refresh_state(self) -> None:
        if self.tray is None:
            return
        worker_state = getattr(self.supervisor, "state", "")
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


def build_app(settings: Settings, *, region: str | None = None, settings_path: Path | None = None,
              use_tray: bool = True, use_hotkeys: bool = True, temp_root: Path | None = None, **parts) -> App:
    """Every part of the app, built from `settings` (a part given in `parts` is used instead). Temporary files
    (the worker's state folder, the tray's icons) go under `temp_root` (None: the system temp folder)."""
    from deskeye.client import WorkerClient
    from deskeye.first_look import wants_first_look
    from deskeye.hooks import build_runner
    from deskeye.notify import Notifier
    from deskeye.providers import QuickAnswerer, ScreenMemory
    from deskeye.supervisor import WorkerSupervisor
    supervisor = parts.pop("supervisor", None) or WorkerSupervisor(settings, temp_root=temp_root)
    if "first_look" not in parts and wants_first_look(settings.worker):
        parts["first_look"] = FirstLookPart.build(settings, temp_root=temp_root)
    screen_memory = parts.pop("screen_memory", None) or ScreenMemory()
    notifier = parts.pop("notifier", None) or Notifier()
    built = {"supervisor": supervisor, "screen_memory": screen_memory, "notifier": notifier,
             "client": parts.pop("client", None) or WorkerClient(supervisor, settings),
             "quick": parts.pop("quick", None) or QuickAnswerer(settings, screen_memory),
             "hooks": parts.pop("hooks", None) or build_runner(settings, notifier)}
    return App(settings, region=region, settings_path=settings_path, use_tray=use_tray, use_hotkeys=use_hotkeys,
               temp_root=temp_root, **built, **parts)


def worker_overrides(args) -> dict[str, str]:
    """--engine / --model as [worker] settings. `--model` alone means that model or a clear failure (never a
    silent fall back to OCR), and a model path that does not exist is refused here, in one line."""
    engine, model = getattr(args, "engine", None), getattr(args, "model", None)
    overrides = {k: v for k, v in (("engine", engine), ("model", model)) if v}
    if model:
        if model.startswith(("/", "./", "../", "~")) and not Path(model).expanduser().exists():
            raise UsageError(f"--model {model}: no such folder. Give a model folder or a Hugging Face id "
                             "(e.g. openbmb/MiniCPM-V-4.6), or leave --model out to use the OCR engine.")
        if not engine:
            overrides["engine"] = "transformers"
    return overrides


def cmd_run(args, settings: Settings) -> int:
    """`deskeye run [--region X,Y,W,H] [--engine E] [--model M]`: run until Quit (tray), Ctrl+C or SIGTERM.

    SIGTERM/SIGINT count from the first line, whatever start-up is doing; a second one while stopping ends the
    process at once. Whatever ends the run (those, an exception, the X server going away), the worker is stopped
    and the run folder, with every temporary file of the run, is removed."""
    with StopSignals() as signals, RunFolder() as folder:
        worker = worker_overrides(args)
        if worker:
            settings = with_overrides(settings, worker=worker)
        path = Path(args.settings) if getattr(args, "settings", None) else default_settings_path()
        app = build_app(settings, region=args.region, settings_path=path, temp_root=folder.path)
        signals.on_stop(app.quit)              # at once, if a signal came while building
        on_display_lost(lambda: _display_lost(app))
        try:
            app.start()
            if not app.is_stopping:
                print(app.ready_line(), file=sys.stderr, flush=True)
            app.wait()
        finally:
            app.quit()
            _wait_until_stopped(app)
    return 0


def _wait_until_stopped(app: App) -> None:
    """Every part stopped; else (threads stuck on a frozen X server would keep the process alive) end it now."""
    if not app.wait(JOIN_TIMEOUT_S * 2):
        exit_now(EXIT_STUCK, f"did not stop within {JOIN_TIMEOUT_S * 2:.0f} s; stopping now.")
    stuck = app.stuck_threads()
    if stuck:
        exit_now(EXIT_STUCK, f"stopped, but {', '.join(stuck)} never finished (is the X server frozen?); "
                             "exiting without them.")


def _display_lost(app: App) -> None:
    """Called by Xlib's IO-error handler on the thread that found the X server gone; ends the process."""
    threading.excepthook = _quiet_x_connection_errors
    write_stderr(f"deskeye: lost the X display {os.environ.get('DISPLAY', '')} (the X server stopped or the session "
                 "ended); stopping.\n")
    app.quit()
    app.stop_workers()                         # first: the threads that draw are stuck on the dead display
    app.wait(DISPLAY_LOST_WAIT_S)
    exit_now(EXIT_DISPLAY_LOST)


def _quiet_x_connection_errors(args) -> None:
    """Once the display is gone, threads that talk to it (the hotkey listener) die of it: expected, no traceback."""
    if isinstance(args.exc_value, (OSError, *_xlib_connection_errors())):
        log.debug("%s ended: %s", args.thread.name if args.thread else "a thread", args.exc_value)
        return
    threading.__excepthook__(args)


def _xlib_connection_errors() -> tuple[type, ...]:
    try:
        from Xlib.error import ConnectionClosedError
    except ImportError:
        return ()
    return (ConnectionClosedError,)
