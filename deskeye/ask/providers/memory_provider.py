"""Screen memory: "what did you see last time?", "刚才看到了什么" — from the last description, no model.

`ScreenMemory` is the small thread-safe object the app updates after every description (capture
thread) and the tray reads (UI thread). With nothing remembered yet the provider gives no answer,
so the question falls through to the standard tier, which looks at the screen now.
"""

from __future__ import annotations

import re
import threading
from collections import deque
from dataclasses import dataclass
from datetime import datetime

from deskeye.ask.providers.base import QueryContext, clock_text, minutes_text
from deskeye.prompt import Description

NAME = "memory"
LABEL, LABEL_ZH = "Screen memory", "屏幕记忆"     # who "did not answer" when it is too slow
_EN = re.compile(
    r"\b(saw|what was that|what were those|did you (just )?see|you (just )?seen?|"
    r"(on|did) (the )?screen (show |say )?(before|earlier|a (moment|minute|second) ago)|"
    r"(screen|it) (show|showed|said) (earlier|before)|last (thing|time|frame|screen))\b", re.I)
_ZH = re.compile(r"(刚才|刚刚|上次|上一次|之前|方才).{0,8}(看到|看见|是什么|是啥|屏幕|画面|内容|那个)"
                 r"|看到的(是|东西|内容)")


@dataclass(frozen=True)
class Seen:
    summary: str
    key_objects: tuple[str, ...]
    at: datetime                   # aware wall-clock time it was remembered


class ScreenMemory:
    """The last few descriptions the app produced. Safe to call from any thread."""

    def __init__(self, max_items: int = 3):
        if max_items < 1:
            raise ValueError("ScreenMemory needs max_items >= 1.")
        self._items: deque[Seen] = deque(maxlen=max_items)
        self._lock = threading.Lock()

    def remember(self, description, at: datetime | None = None) -> None:
        """Store a protocol `Description` (anything with .summary and .key_objects)."""
        seen = Seen(str(description.summary), tuple(str(o) for o in description.key_objects),
                    at or datetime.now().astimezone())
        with self._lock:
            self._items.append(seen)

    def last(self):
        """The last `Description` remembered, or None."""
        seen = self.last_seen()
        if seen is None:
            return None
        return Description(seen.summary, list(seen.key_objects))

    def last_seen(self) -> Seen | None:
        with self._lock:
            return self._items[-1] if self._items else None

    def recent(self) -> list[Seen]:
        with self._lock:
            return list(self._items)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


def matches(query: str) -> bool:
    return bool(_EN.search(query) or _ZH.search(query))


def answer(query: str, ctx: QueryContext) -> str | None:
    memory = ctx.memory
    seen = memory.last_seen() if memory is not None else None
    if seen is None:
        return None
    minutes = max(0, int((ctx.now - seen.at).total_seconds() // 60))
    ago_en = "just now" if minutes == 0 else f"{minutes_text(minutes, 'en')} ago"
    ago_zh = "刚刚" if minutes == 0 else f"{minutes_text(minutes, 'zh')}前"
    when = clock_text(seen.at.astimezone(ctx.now.tzinfo))
    summary = seen.summary.strip() or ctx.say("(no summary)", "(无摘要)")
    objects_en = f" Key items: {', '.join(seen.key_objects)}." if seen.key_objects else ""
    objects_zh = f"要点:{'、'.join(seen.key_objects)}。" if seen.key_objects else ""
    return ctx.say(f"Last time ({ago_en}, {when}) I saw: {summary.rstrip('.')}.{objects_en}",
                   f"上次({ago_zh},{when})看到:{summary.rstrip('。')}。{objects_zh}")
