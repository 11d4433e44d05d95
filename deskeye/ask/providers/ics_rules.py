"""The repeat rules (RRULE) of calendar events: reading and checking one, finding a rule that never occurs, and
restarting a series whole periods later so that expanding it over a window costs what the window holds, not what
lies between DTSTART and the window (see `ics` for the bounds). Also the small value helpers `ics` shares.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime, time, timedelta

_FIXED_PERIODS = {"SECONDLY": timedelta(seconds=1), "MINUTELY": timedelta(minutes=1),
                  "HOURLY": timedelta(hours=1), "DAILY": timedelta(days=1), "WEEKLY": timedelta(weeks=1)}
_MONTHS_PER_PERIOD = {"MONTHLY": 1, "YEARLY": 12}
_GREGORIAN_CYCLE_YEARS = 400                # the Gregorian calendar (weekdays included) repeats after this
_PROBE_START = datetime(9600, 1, 1)         # 9600..9999: the last whole cycle a datetime can hold


class BadEvent(Exception):
    """What is wrong with one event (a date or a rule); becomes a ProviderError naming the file and the event."""


@dataclass(frozen=True)
class Rule:
    """One RRULE of an event: what it costs dateutil to walk it, and how to restart it later."""
    text: str
    freq: str
    interval: int
    count: int | None

    @property
    def step(self) -> timedelta | None:
        """The fixed length of one period (SECONDLY..WEEKLY); None for MONTHLY and YEARLY."""
        period = _FIXED_PERIODS.get(self.freq)
        return period * self.interval if period is not None else None

    @property
    def cycle_years(self) -> int:
        """A whole number of MONTHLY/YEARLY periods that is also whole Gregorian cycles."""
        return _GREGORIAN_CYCLE_YEARS * self.interval

    def periods(self, first: datetime, last: datetime) -> int:
        """How many periods dateutil steps through from `first` to `last` (naive wall times)."""
        if last <= first:
            return 1
        if self.step is not None:
            return (last - first) // self.step + 1
        months = (last.year - first.year) * 12 + last.month - first.month
        return months // (_MONTHS_PER_PERIOD[self.freq] * self.interval) + 1

    def shift_count(self, start: datetime, target: datetime) -> int:
        """How many whole shifts (see `shifted`) move `start` forward to at most `target`."""
        if target <= start:
            return 0
        if self.step is not None:
            return (target - start) // self.step
        return max(0, (target.year - start.year - 1) // self.cycle_years)

    def shifted(self, value: date, num_shifts: int) -> date:
        """`value` (a date, or a naive wall-clock datetime) moved by whole periods, the grid unchanged."""
        if num_shifts == 0:
            return value
        if self.step is not None:
            return value + self.step * num_shifts
        return value.replace(year=value.year + self.cycle_years * num_shifts)

    def can_shift(self, value: date) -> bool:
        """A DATE start can only move by whole days."""
        return isinstance(value, datetime) or self.step is None or self.step % timedelta(days=1) == timedelta(0)


def read_rule(recur, start: date) -> Rule:
    from dateutil.rrule import rrulestr
    text = recur.to_ical().decode()
    freq = str(recur.get("FREQ", [""])[0]).upper()
    if freq not in _FIXED_PERIODS and freq not in _MONTHS_PER_PERIOD:
        raise BadEvent(f"has a repeat rule without a known FREQ (RRULE:{text}).")
    interval = int(recur.get("INTERVAL", [1])[0])
    count = int(recur["COUNT"][0]) if "COUNT" in recur else None
    if interval < 1 or (count is not None and count < 0):
        raise BadEvent(f"has a repeat rule with INTERVAL below 1 or a negative COUNT (RRULE:{text}).")
    try:
        rrulestr(_rule_text(recur, drop=("UNTIL",)), dtstart=naive(start))   # what the library will parse
    except (ValueError, TypeError, OverflowError) as exc:
        raise BadEvent(f"has a repeat rule that cannot be read (RRULE:{text}: {short_error(exc)}).") from None
    return Rule(text, freq, interval, count)


def never_occurs(rule: Rule, start: date) -> bool:
    """True if the rule yields nothing in a whole Gregorian cycle with its own grid: then it never does.

    The rule is moved (by whole periods, or whole 400-year cycles for MONTHLY/YEARLY) to start in the
    last cycle datetime can hold, so dateutil's walk ends at the year 9999 within one cycle (~0.6 s for
    a DAILY rule that never matches, microseconds for one that does)."""
    from dateutil.rrule import rrulestr
    import icalendar
    first = naive(start)
    if not rule.can_shift(start):
        return False
    probe_start = rule.shifted(first, rule.shift_count(first, _PROBE_START))
    recur = icalendar.vRecur.from_ical(rule.text)
    try:
        probe = rrulestr(_rule_text(recur, drop=("UNTIL", "COUNT")), dtstart=probe_start)
        return next(iter(probe), None) is None
    except (ValueError, OverflowError):
        return False       # left to the per-window checks


def _rule_text(recur, *, drop: tuple[str, ...]) -> str:
    import icalendar
    kept = icalendar.vRecur({key: value for key, value in recur.items() if key not in drop})
    return kept.to_ical().decode()


def without_rules(core, empty: list[Rule]):
    copy = core.copy()
    kept = [recur for recur in as_list(core.get("RRULE")) if recur.to_ical().decode() not in {r.text for r in empty}]
    copy.pop("RRULE", None)
    for recur in kept:
        copy.add("RRULE", recur)
    return copy


def shifted_component(core, rule: Rule, num_shifts: int):
    """A copy of the series core whose DTSTART (and DTEND) moved forward by whole periods of its rule."""
    from icalendar.prop import vDDDTypes
    copy = core.copy()
    for name in ("DTSTART", "DTEND"):
        if core.get(name) is not None:
            value = core.decoded(name)
            moved = rule.shifted(naive(value) if isinstance(value, datetime) else value, num_shifts)
            if isinstance(value, datetime) and value.tzinfo is not None:
                moved = moved.replace(tzinfo=value.tzinfo)
            copy[name] = vDDDTypes(moved)
    return copy


def series_of(components: list):
    from recurring_ical_events import EventAdapter, Series
    return Series([EventAdapter(component) for component in components])


def rule_cost(rule: Rule, walk_start: datetime, window_end: datetime) -> int:
    periods = rule.periods(walk_start, window_end)
    return min(periods, rule.count) if rule.count is not None else periods


# ---------------------------------------------------------------- values shared with ics.py


def as_list(value) -> list:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def naive(value: date) -> datetime:
    """A date as local midnight, a datetime as its wall-clock time (no zone)."""
    if not isinstance(value, datetime):
        return datetime.combine(value, time(0))
    return value.replace(tzinfo=None)


def short_error(exc: BaseException) -> str:
    """An exception's message on one line and at most 200 characters, for an error shown to the user."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:199] + "…"
