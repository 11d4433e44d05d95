"""Answering one job on the app's job thread: a describe or a typed question, from a frame to an answer on the
overlay, in the memories and to the hooks.

A describe asks the model about the frame (an automatic one brings its own; a user's gets a fresh grab unless paused
or private). With a vision model it is answered in two stages (deskeye/ask/first_look.py): the OCR worker's first
look is shown at once, then the model's answer replaces it; only the model's answer is remembered and fires hooks.
A typed question is routed first (deskeye/ask/asking.py): a quick one is answered without the model, a deep one
gets more room and a desktop notification when its answer is in.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

from deskeye.ask.asking import route_question
from deskeye.ask.first_look import (FIRST_LOOK_LABEL, MAX_HEAD_START_S, MAX_WAIT_AFTER_MODEL_FAILED_S, Stages,
                                    model_shares_this_cpu)
from deskeye.errors import DeskEyeError
from deskeye.hotkey_syntax import display_name
from deskeye.jobs import DESCRIBE, Job
from deskeye.language import N_, _, ui_language
from deskeye.parts import AppParts
from deskeye.prompt import Description, describe_question
from deskeye.see.capture import Frame
from deskeye.see.privacy import PrivacyVerdict, check_privacy
from deskeye.see.window_list import SeenWindows
from deskeye.settings import Settings
from deskeye.ui.overlay import THINKING_TEXT, Kind
from deskeye.worker.client import Answer
from deskeye.worker.endpoint import WorkerLimits

log = logging.getLogger(__name__)

DEEP_MAX_TOKENS_FACTOR = 4       # a deep question may answer at length: this many times worker.max_tokens
# What the user reads: English messages, shown in the user's language (deskeye/language.py).
PAUSED_NOTICE = N_("DeskEye is paused and not looking at the screen. Resume it from the tray or press {key}.")
MODEL_FAILED_UNDER_FIRST_LOOK = N_("{first_look}: {summary}\nThe model did not answer: {error}")
INTERNAL_ERROR = N_("Internal error: {error}")

Show = Callable[..., None]       # show(kind, text="", key_objects=()): put it on the overlay


def deep_max_tokens(configured_max_tokens: int, limits: WorkerLimits) -> int:
    """The room a deep question's answer gets: DEEP_MAX_TOKENS_FACTOR times worker.max_tokens, within the most the
    worker accepts."""
    return min(configured_max_tokens * DEEP_MAX_TOKENS_FACTOR, limits.max_tokens_limit)


class Answering:
    """Serves the app's jobs, one at a time, on the job thread. `show` puts content on the overlay; `is_paused`
    says whether the user paused watching (then nothing is grabbed for a user's request, and nothing remembered)."""

    def __init__(self, settings: Settings, parts: AppParts, *, show: Show, is_paused: Callable[[], bool]):
        self.settings = settings
        self.parts = parts
        self._show = show
        self._is_paused = is_paused

    def serve(self, job: Job) -> None:
        """One job; an error is shown (a user's job) or logged and retried on the next tick (an automatic one)."""
        try:
            if job.kind == DESCRIBE:
                self._describe(job)
            else:
                self._ask(job)
        except DeskEyeError as exc:
            self._fail(job, str(exc))
        except Exception as exc:            # a bug must not end the job thread: show it, keep serving
            log.exception("job %s failed", job)
            self._fail(job, _(INTERNAL_ERROR).format(error=exc))

    def privacy(self, seen: SeenWindows | None = None) -> PrivacyVerdict:
        """Whether DeskEye may look now: no excluded window active or in the watched region (`seen`: the session's
        windows if the caller has just read them, deskeye.see.window_list.SessionWindows.read; DeskEyeError where
        the desktop should tell them and does not)."""
        seen = self.parts.window_list.read() if seen is None else seen
        return check_privacy(self.settings.excluded_titles, region=self.parts.grabber.privacy_region(),
                             windows=seen.windows, active=seen.active)

    def _fail(self, job: Job, message: str) -> None:
        if job.is_user:
            self._show(Kind.ERROR, message)
        else:
            log.warning("automatic describe failed: %s", message)
            self.parts.change.reset()        # try again on the next tick

    def _describe(self, job: Job) -> None:
        if self._is_paused() and not job.is_user:
            return                           # queued before the pause: dropped
        frame = job.frame or self._user_frame()
        if frame is None:
            return
        png = self._png(frame)
        stages = self._first_look(png, frame)
        question = describe_question(ui_language())
        try:
            answer = self.parts.client.ask(question, png, self.parts.memory.turns(),
                                           on_text=self._stream if stages is None else stages.model_text,
                                           windows=frame.windows)
        except DeskEyeError as exc:
            if stages is None or not self._keep_first_look(job, stages, exc):
                raise
            return
        if stages is not None:
            stages.finish()                  # a first look still on its way is not shown over the answer
        self.parts.change.mark_described(frame.image, frame.masks)
        self._remember(question if job.is_user else "", answer)
        self._show(Kind.ANSWER, answer.summary, answer.key_objects)   # a changed screen is shown too

    def _ask(self, job: Job) -> None:
        routed = route_question(job.question, self.parts.router(), self.parts.quick)
        if routed.quick_answer is not None:
            quick = routed.quick_answer
            self._show(Kind.ERROR if quick.is_error else Kind.ANSWER, quick.text)
            return
        deep = routed.tier == "deep"
        if deep:
            self._show(Kind.THINKING, _(THINKING_TEXT))
        frame = self._user_frame()
        if frame is None:
            return
        max_tokens = None
        if deep:
            max_tokens = deep_max_tokens(self.settings.worker.max_tokens, self.parts.client.limits())
        answer = self.parts.client.ask(job.question, self._png(frame), self.parts.memory.turns(),
                                       max_tokens=max_tokens, on_text=None if deep else self._stream,
                                       windows=frame.windows)
        self._remember(job.question, answer)
        self._show(Kind.ANSWER, answer.shown_text(), answer.key_objects)     # with a note if the question was cut
        if deep:
            self.parts.notifier.notify("DeskEye", answer.shown_text())

    def _first_look(self, png: bytes, frame: Frame) -> Stages | None:
        """Two stages for this describe: the OCR worker reads the frame while the model answers. None: one stage
        (no first look configured, the model's worker is itself OCR, or the OCR worker is not serving)."""
        first_look = self.parts.first_look
        if first_look is None or not first_look.is_useful(self.parts.supervisor):
            return None
        stages = Stages(self._show)
        if not first_look.ask(stages, png, frame.windows):
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
        self._show(Kind.ERROR, _(MODEL_FAILED_UNDER_FIRST_LOOK).format(first_look=_(FIRST_LOOK_LABEL),
                                                                       summary=first.summary, error=error),
                   first.key_objects)
        if not job.is_user:
            self.parts.change.reset()        # try the model again on the next tick
        return True

    def _stream(self, text_so_far: str) -> None:
        """A streamed answer's summary so far: the overlay grows with it (as "thinking" until the whole answer,
        with its key objects, is in)."""
        if text_so_far:
            self._show(Kind.THINKING, f"{text_so_far}…")

    def _user_frame(self) -> Frame | None:
        """A fresh frame for a user's request, or None (shown why) when paused or an excluded window is active."""
        if self._is_paused():
            self._show(Kind.NOTICE, _(PAUSED_NOTICE).format(key=display_name(self.settings.hotkeys.pause)))
            return None
        verdict = self.privacy()
        if verdict.is_excluded:
            self._show(Kind.NOTICE, verdict.reason)
            return None
        return self.parts.grabber.grab()

    def _png(self, frame: Frame) -> bytes:
        png = frame.png()
        folder = self.settings.capture.debug_save_frames_dir
        if folder:
            path = Path(folder).expanduser()
            path.mkdir(parents=True, exist_ok=True)
            (path / f"frame-{time.time_ns()}.png").write_bytes(png)
        return png

    def _remember(self, question: str, answer: Answer) -> None:
        """Screen memory and hooks get every description; the conversation memory what the user asked
        (`question`, "" for automatic ones). Nothing is kept if the user paused while it was on its way."""
        if self._is_paused():
            return
        description = Description(answer.summary, list(answer.key_objects))
        self.parts.screen_memory.remember(description)
        if question:
            self.parts.memory.add(question, answer.summary)
        if self.settings.hooks.enabled:
            self.parts.hooks.fire(description)
