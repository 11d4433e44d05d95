"""Rolling conversation memory: the last few (question, answer) turns, carried into the next prompt.

The app keeps it (the worker is stateless). Each turn is kept bounded (deskeye/prompt.py: a question or answer of
at most MAX_TURN_CHARS), so what it holds and what it adds to a prompt stay small whatever was asked. Thread-safe:
the hotkey, the tray and the capture loop may add to it and read it from different threads.
"""

from __future__ import annotations

import threading
from collections import deque

from deskeye.prompt import Turn, bound_turn


class ConversationMemory:
    def __init__(self, max_turns: int):
        if max_turns < 0:
            raise ValueError(f"max_turns must be >= 0; got {max_turns}.")
        self.max_turns = max_turns
        self._turns: deque[Turn] = deque(maxlen=max_turns)
        self._lock = threading.Lock()

    def add(self, question: str, answer: str) -> None:
        """Remember one turn (each side cut to MAX_TURN_CHARS); the oldest falls out once there are more than
        `max_turns`."""
        if self.max_turns == 0:
            return
        turn = bound_turn(Turn(question, answer))
        with self._lock:
            self._turns.append(turn)

    def turns(self) -> list[Turn]:
        """The remembered turns, oldest first (a copy: safe to use while others add)."""
        with self._lock:
            return list(self._turns)

    def last(self) -> Turn | None:
        """The newest turn, or None ("what was that?")."""
        with self._lock:
            return self._turns[-1] if self._turns else None

    def clear(self) -> None:
        with self._lock:
            self._turns.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._turns)
