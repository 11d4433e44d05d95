"""Quick answers without the model: clock, calendar, mail, system figures, and what was seen last.

`QuickAnswerer(settings, screen_memory).answer(query)` picks a provider by the query's words (English
and Chinese) and returns a `QuickAnswer`, or None when no provider can answer — the caller then
sends the query to the standard tier. It never raises: a provider that is not configured or cannot
reach its source answers with the reason (`is_error=True`); an unexpected failure is logged and
gives None.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import datetime
from types import ModuleType
from typing import Callable

from deskeye.errors import ProviderError
from deskeye.providers import calendar, clock, mail, memory_provider, system
from deskeye.providers.base import QueryContext
from deskeye.providers.memory_provider import ScreenMemory, Seen
from deskeye.textlang import detect_lang

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

    def answer(self, query: str, *, now: datetime | None = None) -> QuickAnswer | None:
        """Answer at once from a local source, or None (the caller falls through to the standard tier)."""
        provider = pick_provider(query) if query.strip() else None
        if provider is None:
            return None
        started = time.perf_counter()
        ctx = QueryContext(query, detect_lang(query), now or self._now(), self._settings, self._memory)
        try:
            text = provider.answer(query, ctx)
            is_error = False
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
