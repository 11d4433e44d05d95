"""Quick answers without the model: clock, calendar, mail, system figures, and what was seen last.

`QuickAnswerer(settings, screen_memory).answer(query)` picks a provider by the query's words (English
and Chinese) and returns a `QuickAnswer`, or None when no provider can answer — the caller then
sends the query to the standard tier. It never raises: a provider that is not configured or cannot
reach its source answers with the reason (`is_error=True`); an unexpected failure is logged and
gives None.

It never blocks its caller (the app's one job thread, behind which the hotkeys queue) for long either:
each provider runs on its own reusable daemon thread and the caller waits at most the provider's
deadline (`providers.quick_answer_timeout_s`; for mail the IMAP check's own deadline plus a little). Past it
the caller gets an error answer at once while the provider finishes, or hangs, in the background. A
question for a provider still busy that way waits for it within its own deadline, then answers "still
busy" instead of starting a second call: at most one call per provider is ever in flight.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import datetime
from types import ModuleType
from typing import Callable

from deskeye.errors import ProviderError
from deskeye.ask.providers import calendar, clock, mail, memory_provider, system
from deskeye.ask.providers.base import QueryContext
from deskeye.ask.providers.memory_provider import ScreenMemory, Seen
from deskeye.language import detect_lang

log = logging.getLogger(__name__)

PROVIDERS: tuple[ModuleType, ...] = (memory_provider, mail, system, calendar, clock)
# Most specific first: "how busy is the CPU" is a system question, "what time is my next meeting" a
# calendar one, "is my laptop free at 4" a calendar one, not a system or clock one.
_MATCH_ORDER: tuple[tuple[ModuleType, Callable[[str], bool]], ...] = (
    (memory_provider, memory_provider.matches),
    (mail, mail.matches),
    (system, system.matches_figure),
    (calendar, calendar.matches),
    (system, system.matches),
    (clock, clock.matches),
)

__all__ = ["QuickAnswer", "QuickAnswerer", "ScreenMemory", "Seen", "PROVIDERS", "pick_provider"]

_IDLE_EXIT_S = 60.0       # a provider's thread ends after this long without a question


@dataclass(frozen=True)
class QuickAnswer:
    text: str
    provider: str          # "clock" | "calendar" | "mail" | "system" | "memory"
    is_error: bool = False  # the text explains why the provider could not answer (not configured, refused...)
    elapsed_ms: float = 0.0


def pick_provider(query: str) -> ModuleType | None:
    """The first provider whose words occur in the query, or None."""
    return next((provider for provider, matches in _MATCH_ORDER if matches(query)), None)


class QuickAnswerer:
    def __init__(self, settings, screen_memory: ScreenMemory | None = None, *,
                 clock_now: Callable[[], datetime] = lambda: datetime.now().astimezone()):
        self._settings = settings.providers if hasattr(settings, "providers") else settings
        self._memory = screen_memory
        self._now = clock_now
        self._threads: dict[str, _ProviderThread] = {}
        self._threads_lock = threading.Lock()

    def answer(self, query: str, *, now: datetime | None = None) -> QuickAnswer | None:
        """Answer within the provider's deadline from a local source, or None (the caller falls through
        to the standard tier)."""
        provider = pick_provider(query) if query.strip() else None
        if provider is None:
            return None
        started = time.perf_counter()
        ctx = QueryContext(query, detect_lang(query), now or self._now(), self._settings, self._memory)
        timeout_s = self._timeout_s(provider)
        deadline = time.monotonic() + timeout_s
        future = self._thread(provider).submit(lambda: provider.answer(query, ctx), wait_s=timeout_s)
        if future is None:
            log.warning("quick provider %s is still busy with an earlier question", provider.NAME)
            return QuickAnswer(_still_busy(provider, timeout_s, ctx), provider.NAME, True,
                               (time.perf_counter() - started) * 1000)
        try:
            text = future.result(timeout=max(0.0, deadline - time.monotonic()))
            is_error = False
        except FutureTimeout:
            log.warning("quick provider %s gave no answer within %g s to %r", provider.NAME, timeout_s, query)
            text, is_error = _too_slow(provider, timeout_s, ctx), True
        except ProviderError as exc:
            text, is_error = str(exc), True
        except Exception:  # noqa: BLE001 - a quick answer must never break the Ask flow
            log.exception("quick provider %s failed on %r; falling through to the model", provider.NAME, query)
            return None
        if text is None:
            return None
        elapsed_ms = (time.perf_counter() - started) * 1000
        log.info("quick answer from %s in %.1f ms", provider.NAME, elapsed_ms)
        return QuickAnswer(text, provider.NAME, is_error, elapsed_ms)

    def _timeout_s(self, provider: ModuleType) -> float:
        """The provider's own deadline if it has one (mail: the whole IMAP check), else the setting."""
        own = getattr(provider, "timeout_s", None)
        return own(self._settings) if own is not None else self._settings.quick_answer_timeout_s

    def _thread(self, provider: ModuleType) -> "_ProviderThread":
        with self._threads_lock:
            return self._threads.setdefault(provider.NAME, _ProviderThread(provider.NAME))


def _too_slow(provider: ModuleType, timeout_s: float, ctx: QueryContext) -> str:
    return ctx.say(f"{provider.LABEL} did not answer within {timeout_s:g} s; it is still working on it in the "
                   "background. Ask again in a moment.",
                   f"{provider.LABEL_ZH}在 {timeout_s:g} 秒内没有回答,仍在后台处理,请稍后再问。")


def _still_busy(provider: ModuleType, timeout_s: float, ctx: QueryContext) -> str:
    return ctx.say(f"{provider.LABEL} is still busy with an earlier question (for more than {timeout_s:g} s); "
                   "ask again when it is done.",
                   f"{provider.LABEL_ZH}还在处理上一个问题(已超过 {timeout_s:g} 秒),请稍后再问。")


class _ProviderThread:
    """One provider's calls, one at a time, on a reusable daemon thread.

    Daemon, so a provider stuck in a call never keeps the process from exiting; one call at a time, so a
    provider that hangs costs one thread, however often it is asked; the thread ends after _IDLE_EXIT_S
    without a call and the next call starts a new one."""

    def __init__(self, name: str):
        self._name = name
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._is_busy = False
        self._thread: threading.Thread | None = None

    def submit(self, call: Callable[[], object], *, wait_s: float) -> Future | None:
        """The future result of `call`, or None if the previous call has not finished within `wait_s`."""
        future: Future = Future()
        with self._idle:
            if not self._idle.wait_for(lambda: not self._is_busy, timeout=wait_s):
                return None
            self._is_busy = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"deskeye-provider-{self._name}",
                                                daemon=True)
                self._thread.start()
            self._calls.put((call, future))
        return future

    def _run(self) -> None:
        while True:
            try:
                call, future = self._calls.get(timeout=_IDLE_EXIT_S)
            except queue.Empty:
                with self._lock:
                    if not self._is_busy:       # nothing was submitted meanwhile: this thread is done
                        self._thread = None
                        return
                continue
            try:
                future.set_result(call())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                future.set_exception(exc)
            finally:
                with self._idle:
                    self._is_busy = False
                    self._idle.notify()
