"""Events of an iCalendar (.ics) file as concrete occurrences in time: icalendar reads the file,
recurring-ical-events expands the recurrences (RRULE, RDATE, EXDATE, moved and cancelled instances,
RANGE=THISANDFUTURE).

A small file must not be able to hold a question hostage, so recurrences are only ever expanded over the
window a question asks about, and the work for one window is bounded whatever the file says:
- a rule without COUNT is restarted a whole number of its periods before the window ("rebased"): the
  occurrences in the window are the same, and an event repeating every second since 2020 costs what one
  that started today costs. (dateutil, under both libraries, otherwise steps through every repetition
  from DTSTART on.)
- a rule that can never occur (BYMONTH=2;BYMONTHDAY=30) is found once, when the file is read, by trying it
  over the last whole 400-year cycle of the Gregorian calendar that datetime holds (the calendar,
  weekdays included, repeats every 400 years); it is then dropped instead of being walked to the year
  9999 on every question.
- what is still too much for one window (more than MAX_RULE_PERIODS steps of one rule, or more than
  MAX_WINDOW_OCCURRENCES occurrences of one event) is a ProviderError naming the file and the event.
Dates outside MIN_EVENT_YEAR..MAX_EVENT_YEAR, a duration over MAX_EVENT_DURATION and rules or dates that
cannot be read are ProviderErrors as well, raised when the file is read (never a traceback).

Times: TZID times (VTIMEZONE or IANA names, via icalendar), UTC, floating times (= the local zone `tz`),
all-day events (DATE values: local midnight to DTEND, default one day). STATUS:CANCELLED is dropped,
TRANSP:TRANSPARENT is shown but not busy. Only VEVENTs are read. The repeat rules themselves (reading,
probing, restarting) are in `ics_rules`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta, tzinfo
from itertools import islice
from pathlib import Path

from deskeye.ask.providers.ics_rules import (BadEvent, Rule, as_list, naive, never_occurs, read_rule, rule_cost,
                                             series_of, shifted_component, short_error, without_rules)
from deskeye.errors import ProviderError

MAX_CALENDAR_BYTES = 64 * 1024 * 1024    # a calendar file larger than this is refused, not read into memory
MIN_EVENT_YEAR = 1000
MAX_EVENT_YEAR = 9000
MAX_EVENT_DURATION = timedelta(days=3660)   # ten years: longer is a broken DURATION or DTEND
MAX_RULE_PERIODS = 20_000                   # steps of one RRULE for one window (~0.25 s of dateutil)
MAX_WINDOW_OCCURRENCES = 2_000              # occurrences of one event inside one window
_REBASE_AFTER_PERIODS = 50                  # a shorter walk from DTSTART is cheaper than a restarted series
NEXT_EVENT_HORIZON = timedelta(days=366)    # "when is my next meeting" looks this far ahead
# Growing windows for the next event: a dense event is found in the first, a yearly one in the last.
_NEXT_WINDOWS = (timedelta(minutes=1), timedelta(hours=1), timedelta(days=1), timedelta(days=8),
                 timedelta(days=32), NEXT_EVENT_HORIZON)
_MAX_TITLE_CHARS = 80       # of an event's title quoted in an error
_MAX_TEXT_CHARS = 300       # of a title or location shown in an answer
_DST_SLACK = timedelta(hours=2)             # wall time and elapsed time differ by at most this


@dataclass(frozen=True)
class Occurrence:
    title: str
    start: datetime       # aware
    end: datetime         # aware; == start for an event with no duration
    is_all_day: bool
    is_busy: bool         # False for TRANSP:TRANSPARENT (holidays, birthdays)
    location: str = ""

    def covers(self, moment: datetime) -> bool:
        return self.start <= moment < self.end


@dataclass
class _Event:
    """The components of one UID (the series core first) and the library's series for them."""
    title: str
    components: list           # icalendar VEVENTs: the core (if any) first, then moved instances
    start: date                # the core's DTSTART as in the file (date, naive or aware datetime)
    duration: timedelta        # the longest of its components
    rules: tuple[Rule, ...]
    series: object             # recurring_ical_events.Series for the components as they are
    last_start: date | None    # no occurrence starts later (None: no end, e.g. a rule without UNTIL)
    restarted: tuple[int, object] | None = None   # the last restarted series and its number of shifts


class EventCalendar:
    """Occurrences of the events in one .ics file, in the zone `tz` (for floating and all-day times)."""

    def __init__(self, events: list[_Event], tz: tzinfo, source: str = "calendar"):
        self._events = events
        self._tz = tz
        self._source = source

    @classmethod
    def from_file(cls, path: Path, tz: tzinfo) -> "EventCalendar":
        path = Path(path).expanduser()
        try:
            with path.open("rb") as file:
                data = file.read(MAX_CALENDAR_BYTES + 1)
        except OSError as exc:
            raise ProviderError(f"Cannot read the calendar file {path} ({exc.strerror or exc}); "
                                "check providers.calendar_ics in settings.") from None
        if len(data) > MAX_CALENDAR_BYTES:
            raise ProviderError(f"The calendar file {path} is larger than {MAX_CALENDAR_BYTES // 2**20} MiB; "
                                "export a shorter range of your calendar to it.")
        return cls.from_bytes(data, tz, source=str(path))

    @classmethod
    def from_bytes(cls, data: bytes, tz: tzinfo, *, source: str = "calendar") -> "EventCalendar":
        import icalendar
        try:
            calendar = icalendar.Calendar.from_ical(data)
            components = list(calendar.walk("VEVENT"))
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise ProviderError(f"{source} is not a readable iCalendar file ({short_error(exc)}).") from None
        by_uid: dict[str, list] = {}
        for component in components:
            by_uid.setdefault(str(component.get("UID", id(component))), []).append(component)
        return cls([_read_event(group, source) for group in by_uid.values()], tz, source)

    def between(self, start: datetime, end: datetime) -> list[Occurrence]:
        """Occurrences overlapping [start, end) (or starting at `start`), sorted by start."""
        start, end = start.astimezone(self._tz), end.astimezone(self._tz)
        found = []
        for event in self._events:
            for occurrence in self._expand(event, start, end):
                if occurrence.start < end and (occurrence.end > start or occurrence.start >= start):
                    found.append(occurrence)
        return sorted(found, key=lambda o: (o.start, o.title))

    def next_after(self, moment: datetime) -> Occurrence | None:
        """The first occurrence starting at or after `moment`, within NEXT_EVENT_HORIZON."""
        lower = moment
        for span in _NEXT_WINDOWS:
            upper = moment + span
            starting = [o for o in self.between(lower, upper) if lower <= o.start < upper]
            if starting:
                return starting[0]
            lower = upper
        return None

    def at(self, moment: datetime) -> list[Occurrence]:
        """Occurrences under way at `moment`."""
        return [o for o in self.between(moment, moment + timedelta(seconds=1)) if o.covers(moment)]

    def _expand(self, event: _Event, start: datetime, end: datetime) -> list[Occurrence]:
        if self._has_ended(event, start):
            return []
        series = self._series_for(event, start, end)
        found = list(islice(series.between(start, end), MAX_WINDOW_OCCURRENCES + 1))
        if len(found) > MAX_WINDOW_OCCURRENCES:
            raise self._too_dense(event, f"more than {MAX_WINDOW_OCCURRENCES:,} times")
        occurrences = (self._occurrence(item) for item in found)
        return [o for o in occurrences if o is not None]

    def _series_for(self, event: _Event, start: datetime, end: datetime):
        """The event's series, restarted just before the window when that saves work; its cost checked."""
        if not event.rules:
            return event.series
        first = naive(event.start)
        window_start, window_end = self._wall(start, event.start), self._wall(end, event.start)
        rule = event.rules[0]
        num_shifts = 0
        if (len(event.rules) == 1 and rule.count is None and rule.can_shift(event.start)
                and rule.periods(first, window_end) > _REBASE_AFTER_PERIODS):
            lead = event.duration + (rule.step or timedelta(0)) + _DST_SLACK
            num_shifts = rule.shift_count(first, window_start - lead)
        walked = max(rule_cost(r, rule.shifted(first, num_shifts), window_end) for r in event.rules)
        if walked > MAX_RULE_PERIODS:
            raise self._too_dense(event, f"{walked:,} steps of its rule")
        if num_shifts == 0:
            return event.series
        if event.restarted is None or event.restarted[0] != num_shifts:
            event.restarted = (num_shifts, series_of([shifted_component(c, rule, num_shifts) if i == 0 else c
                                                       for i, c in enumerate(event.components)]))
        return event.restarted[1]

    def _has_ended(self, event: _Event, start: datetime) -> bool:
        """True if every occurrence of the event ends before `start` (a day's margin for zones)."""
        if event.last_start is None:
            return False
        last = event.last_start
        last = self._wall(last, event.start) if isinstance(last, datetime) and last.tzinfo else naive(last)
        return last + event.duration + timedelta(days=1) < self._wall(start, event.start)

    def _wall(self, moment: datetime, like: date) -> datetime:
        """`moment` as a naive wall-clock time in the zone of the value `like` (local for floating/DATE)."""
        zone = like.tzinfo if isinstance(like, datetime) and like.tzinfo is not None else self._tz
        return moment.astimezone(zone).replace(tzinfo=None)

    def _occurrence(self, found) -> Occurrence | None:
        component = found.as_component(False)
        if str(component.get("STATUS", "")).upper() == "CANCELLED":
            return None
        return Occurrence(
            title=_clip(str(component.get("SUMMARY", "(untitled)")), _MAX_TEXT_CHARS),
            start=_as_aware(found.start, self._tz),
            end=_as_aware(found.end, self._tz),
            is_all_day=not isinstance(found.start, datetime),
            is_busy=str(component.get("TRANSP", "OPAQUE")).upper() != "TRANSPARENT",
            location=_clip(str(component.get("LOCATION", "")), _MAX_TEXT_CHARS),
        )

    def _too_dense(self, event: _Event, how_much: str) -> ProviderError:
        rules = "; ".join(f"RRULE:{r.text}" for r in event.rules)
        return ProviderError(
            f"The event {event.title!r} in {self._source} repeats too often to answer this ({rules}: "
            f"{how_much} for the time asked about; at most {MAX_RULE_PERIODS:,} steps and "
            f"{MAX_WINDOW_OCCURRENCES:,} occurrences are worked out). Make it repeat less often, or delete it, "
            "in your calendar app.")


class CalendarCache:
    """The parsed calendar of one file, reparsed only when the file changes (mtime or size).

    A file that cannot be used is remembered too, so its error comes back at once until it changes."""

    def __init__(self):
        self._lock = threading.Lock()
        self._key: tuple | None = None
        self._loaded: EventCalendar | ProviderError | None = None

    def load(self, path: str | Path, tz: tzinfo) -> EventCalendar:
        resolved = Path(path).expanduser()
        try:
            stat = resolved.stat()
        except OSError:
            return EventCalendar.from_file(resolved, tz)     # raises the user-facing error
        key = (str(resolved.resolve()), stat.st_mtime_ns, stat.st_size, str(tz))
        with self._lock:
            if key != self._key:
                try:
                    self._loaded = EventCalendar.from_file(resolved, tz)
                except ProviderError as exc:
                    self._loaded = exc
                self._key = key
            if isinstance(self._loaded, ProviderError):
                raise self._loaded
            return self._loaded


# ---------------------------------------------------------------- reading one event


def _read_event(components: list, source: str) -> _Event:
    core = next((c for c in components if c.get("RECURRENCE-ID") is None), components[0])
    components = [core] + [c for c in components if c is not core]
    title = _title(core)
    try:
        for component in components:
            _check_times(component)
        start = core.decoded("DTSTART")
        rules = tuple(read_rule(recur, start) for recur in as_list(core.get("RRULE")))
        empty = [rule for rule in rules if never_occurs(rule, start)]
        if empty:      # dropped: DTSTART and any RDATE still count, as RFC 5545 says
            core, rules = without_rules(core, empty), tuple(r for r in rules if r not in empty)
            components = [core] + components[1:]
        series = series_of(components)
        last_start = _last_start(components)
        duration = max(_duration(c) for c in components)
    except BadEvent as exc:
        raise ProviderError(f"{source} is not a readable iCalendar file: the event {title!r} {exc} Correct or "
                            "delete that event in your calendar app.") from None
    except (ValueError, KeyError, TypeError, IndexError, OverflowError) as exc:
        raise ProviderError(f"{source} is not a readable iCalendar file: the event {title!r} has a date or repeat "
                            f"rule that cannot be read ({short_error(exc)}). Correct or delete that event in your "
                            "calendar app.") from None
    return _Event(title, components, start, duration, rules, series, last_start)


def _last_start(components: list) -> date | None:
    """The latest start any occurrence can have (UNTIL, RDATE, moved instances), or None if unbounded."""
    core = components[0]
    latest = [c.decoded("DTSTART") for c in components]
    for recur in as_list(core.get("RRULE")):
        if "UNTIL" not in recur:
            return None
        latest.append(recur["UNTIL"][0])
    for value in as_list(core.get("RDATE")):
        latest.extend(item.dt[0] if isinstance(item.dt, tuple) else item.dt for item in getattr(value, "dts", []))
    return max(latest, key=lambda value: naive(value.astimezone(_utc()) if _is_aware(value) else value))


def _check_times(component) -> None:
    """Every date of the event readable and in range, and its end computable."""
    if component.get("DTSTART") is None:
        raise BadEvent("has no start (DTSTART).")
    start = _checked_date(component, "DTSTART")
    if component.get("DTEND") is not None:
        _checked_date(component, "DTEND")
    if component.get("RECURRENCE-ID") is not None:
        _checked_date(component, "RECURRENCE-ID")
    for name in ("EXDATE", "RDATE"):
        for value in as_list(component.get(name)):
            for item in getattr(value, "dts", []):
                moment = item.dt[0] if isinstance(item.dt, tuple) else item.dt   # RDATE periods: their start
                _check_year(moment, name)
    duration = _duration(component)
    if abs(duration) > MAX_EVENT_DURATION:
        raise BadEvent(f"lasts {abs(duration).days:,} days; at most {MAX_EVENT_DURATION.days:,} days are read.")
    _check_year(naive(start) + duration, "its end")


def _checked_date(component, name: str) -> date:
    value = component.decoded(name)
    if not isinstance(value, date):
        raise BadEvent(f"has a {name} that is not a date or time ({_raw(component, name)}).")
    _check_year(value, name)
    return value


def _check_year(value: date, what: str) -> None:
    if not MIN_EVENT_YEAR <= value.year <= MAX_EVENT_YEAR:
        raise BadEvent(f"has {what} in the year {value.year}; dates from {MIN_EVENT_YEAR} to "
                       f"{MAX_EVENT_YEAR} are read.")


def _duration(component) -> timedelta:
    raw_start = component.decoded("DTSTART")
    if component.get("DTEND") is not None:
        end = component.decoded("DTEND")
        try:
            return end - raw_start
        except TypeError:      # a date and a time, or an aware and a floating time: compare wall clocks
            return naive(end) - naive(raw_start)
    if component.get("DURATION") is not None:
        duration = component.decoded("DURATION")
        if not isinstance(duration, timedelta):
            raise BadEvent(f"has a DURATION that cannot be read ({_raw(component, 'DURATION')}).")
        return duration
    return timedelta(days=1) if not isinstance(raw_start, datetime) else timedelta(0)


def _title(component) -> str:
    title = " ".join(str(component.get("SUMMARY", "") or component.get("UID", "") or "(untitled)").split())
    return _clip(title, _MAX_TITLE_CHARS)


def _raw(component, name: str) -> str:
    """A property's value as written in the file, for an error message."""
    value = component.get(name)
    raw = value.to_ical() if hasattr(value, "to_ical") else value
    return _clip(raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw), 60)


def _clip(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else text[:max_chars - 1] + "…"


def _is_aware(value: date) -> bool:
    return isinstance(value, datetime) and value.tzinfo is not None


def _utc() -> tzinfo:
    from datetime import timezone
    return timezone.utc


def _as_aware(value: date, tz: tzinfo) -> datetime:
    if not isinstance(value, datetime):
        return datetime.combine(value, time(0), tzinfo=tz)
    return value.astimezone(tz) if value.tzinfo is not None else value.replace(tzinfo=tz)
