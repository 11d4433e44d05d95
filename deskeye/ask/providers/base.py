"""What every quick provider gets: the query, its language, "now", and the provider settings."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import date, datetime

from deskeye.settings import ProviderSettings

_ZH_WEEKDAYS = "一二三四五六日"


@dataclass(frozen=True)
class QueryContext:
    query: str
    lang: str                     # "zh" | "en": the language to answer in
    now: datetime                 # aware local time; injected so answers are reproducible
    settings: ProviderSettings
    memory: object | None = None  # the app's ScreenMemory (memory_provider)

    def say(self, en: str, zh: str) -> str:
        return zh if self.lang == "zh" else en


def has_word(query: str, words: tuple[str, ...]) -> bool:
    """True if any English word/phrase occurs as a whole word (case-insensitive)."""
    q = query.casefold()
    return any(re.search(rf"(?<![a-z]){re.escape(w)}(?![a-z])", q) for w in words)


def has_text(query: str, fragments: tuple[str, ...]) -> bool:
    """True if any fragment (Chinese, or a symbol) occurs anywhere in the query."""
    q = query.casefold()
    return any(f in q for f in fragments)


def day_name(day: date, today: date, lang: str) -> str:
    offset = (day - today).days
    if lang == "zh":
        named = {0: "今天", 1: "明天", 2: "后天", -1: "昨天"}.get(offset)
        return named or f"{day.month}月{day.day}日(周{_ZH_WEEKDAYS[day.weekday()]})"
    named = {0: "today", 1: "tomorrow", -1: "yesterday"}.get(offset)
    return named or day.strftime("%a %d %b").replace(" 0", " ")


def clock_text(moment: datetime) -> str:
    return moment.strftime("%H:%M")


def minutes_text(minutes: int, lang: str) -> str:
    if minutes < 60:
        return f"{minutes} 分钟" if lang == "zh" else f"{minutes} min"
    hours, rest = divmod(minutes, 60)
    if lang == "zh":
        return f"{hours} 小时" + (f" {rest} 分钟" if rest else "")
    return f"{hours} h" + (f" {rest} min" if rest else "")
