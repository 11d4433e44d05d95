"""Hook cooldowns: one per rule AND per distinct object, so one object's cooldown never swallows another's.

An error dialog that fired at 10:00 keeps "error-dialog" quiet for that same dialog until its cooldown ends, but a
different dialog at 10:04 fires at once. Objects are told apart by `object_key`: compared as whole-term matching
compares them (NFKC, casefolded, one space), with every run of digits made one "#" and the punctuation at either
end dropped, so "Battery 15%" and "Battery 14%", or "INBOX (3 unread)" and "Inbox (4 unread)", are one object and
a changing number does not fire a hook again and again.

Times come from an injected monotonic clock. At most MAX_ENTRIES (rule, object) pairs are remembered: past that,
those whose cooldown has ended are forgotten, then the oldest.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from deskeye.hooks.terms import normalise

log = logging.getLogger(__name__)

MAX_ENTRIES = 4096
_END_PUNCTUATION = " .,:;!?…'\"“”‘’()[]{}<>«»「」『』（）【】：，。！？、"


def object_key(text: str) -> str:
    """What makes two key objects the same object for a cooldown (see the module's docstring)."""
    chars, previous = [], ""
    for char in normalise(text):
        if char.isdigit():
            if previous != "#":
                chars.append("#")
            previous = "#"
        else:
            chars.append(char)
            previous = char
    return "".join(chars).strip(_END_PUNCTUATION)


class Cooldowns:
    """When each (rule, object) last fired; `take` says whether it may fire now and, if so, starts its cooldown."""

    def __init__(self, clock: Callable[[], float]):
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str], tuple[float, float]] = {}   # (rule, object key) -> (fired at, cooldown_s)

    def take(self, rule: str, cooldown_s: float, matched_object: str) -> bool:
        key, now = (rule, object_key(matched_object)), self._clock()
        with self._lock:
            fired_at, _ = self._last.get(key, (None, 0.0))
            if fired_at is not None and now - fired_at < cooldown_s:
                log.debug("hook %s cooling down for %r (%.0f s left)", rule, key[1], cooldown_s - (now - fired_at))
                return False
            self._last.pop(key, None)              # re-inserted last: the dict stays in firing order
            self._last[key] = (now, cooldown_s)
            if len(self._last) > MAX_ENTRIES:
                self._forget(now)
            return True

    def __len__(self) -> int:
        return len(self._last)

    def _forget(self, now: float) -> None:
        self._last = {key: (at, cooldown_s) for key, (at, cooldown_s) in self._last.items() if now - at < cooldown_s}
        while len(self._last) > MAX_ENTRIES:
            del self._last[next(iter(self._last))]
