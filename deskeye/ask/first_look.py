"""Two-stage answers: the OCR engine's first look at a frame on the overlay while a vision model answers it.

A vision model takes seconds per describe on a CPU (tens of seconds at real size), and the OCR engine reads the
same frame in a fraction of that. With `worker.ocr_first` (the default) and a vision model configured (a local
one, or an external server at `worker.url`), the app runs a small local OCR worker beside the model's and sends
every describe's frame to both at once:

1. the OCR answer is shown as soon as it comes, as a *first look* (`Kind.FIRST_LOOK`), unless the model's text
   is already on the overlay (a fast model is never covered by a slower first look). When the model runs on this
   machine's CPU, its request waits for the first look (at most MAX_HEAD_START_S): both are CPU-bound, and side
   by side on a few cores the OCR read takes about twice as long (measured on 2 cores beside a 2-thread torch
   load), while the model, on a busy CPU, loses only the moments the OCR leaves a core idle (the work is the
   same either way);
2. the model's streamed answer replaces it as it arrives, then its whole answer;
3. if the model fails, the first look stays on the overlay with the model's error under it.

Only the model's answer is final: it alone goes to the screen memory, the conversation memory and the hooks, so a
hook fires once per describe, on the answer the user ends up with. The first look is display only (it would
otherwise fire hooks on text the model is about to replace, and twice for one describe). With the OCR engine
alone nothing changes: its answer is the one answer.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Callable

from deskeye.errors import DeskEyeError, WorkerUnavailable
from deskeye.ui.overlay import Kind
from deskeye.language import N_, ui_language
from deskeye.prompt import describe_question
from deskeye.settings import Settings, WorkerSettings, with_overrides

if TYPE_CHECKING:
    from deskeye.worker.client import Answer, WorkerClient
    from deskeye.worker.supervisor import WorkerSupervisor

log = logging.getLogger(__name__)

MODEL_ENGINES = ("transformers", "openvino")
FIRST_LOOK_LABEL = N_("First look (OCR)")
MAX_WAIT_AFTER_MODEL_FAILED_S = 10.0    # the model failed first: this long for the first look to show with it
MAX_HEAD_START_S = 1.0                  # a model on this CPU waits at most this long for the first look
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
JOIN_TIMEOUT_S = 5.0                    # at quit, after the OCR worker was stopped (its request fails fast)


def wants_first_look(worker: WorkerSettings) -> bool:
    """A vision model answers (an external server, or our worker with a model) and the user did not turn the
    first look off. `engine = "auto"` with a model counts: if the model cannot load the worker falls back to OCR,
    and the app then skips the first look (see `FirstLookPart.is_useful`)."""
    has_model = bool(worker.url) or worker.engine in MODEL_ENGINES or (worker.engine == "auto" and bool(worker.model))
    return worker.ocr_first and has_model


def model_shares_this_cpu(worker: WorkerSettings) -> bool:
    """The model computes on the cores the OCR worker uses: DeskEye's own worker not on CUDA, or a server on this
    machine (a loopback URL). A remote server, or a GPU, computes elsewhere: its request goes at once."""
    if worker.url:
        from urllib.parse import urlsplit
        host = (urlsplit(worker.url).hostname or "").lower()
        return host in LOOPBACK_HOSTS or host.startswith("127.")
    return worker.device != "cuda"


def ocr_worker_settings(settings: Settings) -> Settings:
    """The settings of the first look's worker: DeskEye's own OCR engine, on the CPU, whatever the model's are."""
    return with_overrides(settings, worker={"engine": "ocr", "model": "", "url": "", "device": "cpu",
                                            "dtype": "auto", "ground_with_ocr": False, "ocr_first": False})


class Stages:
    """What one describe shows, in order: the first look (unless the model's text came first), the model's text
    as it streams, its whole answer. `show(kind, text, key_objects)` puts content on the overlay; it is called
    under a lock, so a first look from the OCR thread can never land after the model's text."""

    def __init__(self, show: Callable[..., None]):
        self._show = show
        self._lock = threading.Lock()
        self._model_spoke = False         # the model's text is on the overlay (or the describe is over)
        self._first: Answer | None = None
        self._first_done = threading.Event()

    # the OCR thread
    def first_look(self, answer: Answer | None) -> None:
        """The OCR answer (None: it failed): shown if the model has not spoken yet."""
        with self._lock:
            self._first = answer
            if answer is not None and answer.summary and not self._model_spoke:
                self._show(Kind.FIRST_LOOK, answer.summary, answer.key_objects)
        self._first_done.set()

    # the job thread
    def model_text(self, text_so_far: str) -> None:
        """The model's summary so far (the client's `on_text`): it replaces the first look."""
        if not text_so_far:
            return
        with self._lock:
            self._model_spoke = True
            self._show(Kind.THINKING, f"{text_so_far}…")

    def finish(self) -> None:
        """The model has answered (or failed): no first look is shown after this returns."""
        with self._lock:
            self._model_spoke = True

    def wait_for_first_look(self, timeout_s: float) -> None:
        """Give the first look a head start of up to `timeout_s` (returns as soon as it is in, or failed)."""
        self._first_done.wait(timeout_s)

    def first_look_for_failure(self, timeout_s: float) -> Answer | None:
        """The model failed: the first look (waiting up to `timeout_s` for it), or None if there is none."""
        self._first_done.wait(timeout_s)
        self.finish()
        with self._lock:
            return self._first if self._first is not None and self._first.summary else None


class FirstLookPart:
    """The app's part for first looks: the local OCR worker (its own supervisor) and a client for it, and at
    most one OCR request in flight (a describe whose previous first look is still being read gets none: the
    model answers it anyway)."""

    def __init__(self, supervisor: WorkerSupervisor, client: WorkerClient):
        self.supervisor = supervisor
        self.client = client
        self._thread: threading.Thread | None = None

    @classmethod
    def build(cls, settings: Settings, *, temp_root=None) -> FirstLookPart:
        from deskeye.worker.client import WorkerClient
        from deskeye.worker.supervisor import WorkerSupervisor
        ocr_settings = ocr_worker_settings(settings)
        supervisor = WorkerSupervisor(ocr_settings, temp_root=temp_root)
        return cls(supervisor, WorkerClient(supervisor, ocr_settings))

    def start(self) -> None:
        self.supervisor.start(wait=False)

    def is_useful(self, model_supervisor: WorkerSupervisor) -> bool:
        """False when the model's own worker serves the OCR engine (`engine = "auto"` fell back to it): its
        answer would only repeat the first look."""
        from deskeye.worker.supervisor import READY
        if model_supervisor.is_external or model_supervisor.state != READY:
            return True
        try:
            return model_supervisor.endpoint(0).engine != "ocr"
        except WorkerUnavailable:
            return True

    def stop(self) -> None:
        """Stop the OCR worker (a request in flight then fails at once) and wait for the request's thread."""
        self.supervisor.stop()
        thread = self._thread
        if thread is not None:
            thread.join(JOIN_TIMEOUT_S)
        self.client.close()

    def ask(self, stages: Stages, png: bytes, windows=()) -> bool:
        """Read `png` with the OCR worker on a thread of its own and hand the answer to `stages`. False (and
        nothing asked) while the OCR worker is not serving or still reading an earlier frame."""
        from deskeye.worker.supervisor import READY
        if self.supervisor.state != READY or (self._thread is not None and self._thread.is_alive()):
            return False
        self._thread = threading.Thread(target=self._read, args=(stages, png, tuple(windows)),
                                        name="deskeye-first-look")
        self._thread.start()
        return True

    def _read(self, stages: Stages, png: bytes, windows) -> None:
        answer = None
        try:
            answer = self.client.ask(describe_question(ui_language()), png, [], windows=windows)
        except DeskEyeError as exc:
            log.info("no first look (OCR) for this frame: %s", exc)
        except Exception:                   # a bug must not leave the describe waiting for it
            log.exception("the first look (OCR) failed")
        finally:
            stages.first_look(answer)
