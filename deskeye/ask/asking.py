"""Routing a typed question, the same way for the Ask box, the tray and `deskeye ask`.

The router picks a tier (quick / standard / deep). A quick question is answered by a local provider without
the model (and without starting the worker); one that no provider can answer goes on to the model as a
standard question, as does everything else.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Routed:
    tier: str                  # the tier that answers: "quick" | "standard" | "deep"
    quick_answer: object = None  # deskeye.ask.providers.QuickAnswer when tier == "quick"

    @property
    def needs_model(self) -> bool:
        return self.quick_answer is None


def route_question(question: str, router, quick) -> Routed:
    """The tier for `question`, with the quick provider's answer when it has one."""
    tier = router.route(question).tier
    if tier == "quick":
        answer = quick.answer(question)
        if answer is not None:
            return Routed("quick", answer)
        return Routed("standard")
    return Routed(tier)
