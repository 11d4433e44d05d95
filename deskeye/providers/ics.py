"""Events of an iCalendar (.ics) file as concrete occurrences in time, with icalendar + dateutil.

Handles: TZID times (VTIMEZONE / IANA names, via icalendar), UTC and floating times (floating =
the local zone), all-day events (DATE values: local midnight to DTEND, default one day), DTEND or
DURATION, every RRULE dateutil knows (DAILY, WEEKLY with BYDAY, MONTHLY, YEARLY, COUNT, UNTIL,
INTERVAL, ...), EXDATE, RDATE, moved or cancelled instances (RECURRENCE-ID), STATUS:CANCELLED and
TRANSP:TRANSPARENT (shown, but not busy). Not handled: RRULE on VTODO/VJOURNAL, RANGE=THISANDFUTURE.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import date, datetime, time, timedelta, tzinfo
from pathlib import Path

from deskeye.errors import ProviderError


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
    title: str
    start: datetime
    duration: timedelta
    is_all_day: bool
    is_busy: bool
    location: str
    rules: object | None = None          # dateutil rruleset, or None for a single event
    excluded: set[datetime] = field(default_factory=set)

    def occurrence(self, start: datetime, tz: tzinfo) -> Occurrence:
        """One instance, shown in `tz` (the arithmetic stays in the event's own zone, across DST)."""
        end = start + self.duration
        return Occurrence(self.title, start.astimezone(tz), end.astimezone(tz), self.is_all_day, self.is_busy,
                          self.location)


class EventCalendar:
    """Occurrences of the events in one .ics file, in the zone `tz` (for floating and all-day times)."""

    def __init__(self, events: list[_Event], tz: tzinfo):
        self._events = events
        self._tz = tz

    @classmethod
    def from_file(cls, path: Path, tz: tzinfo) -> "EventCalendar":
        try:
            data = Path(path).expanduser().read_bytes()
        except OSError as exc:
            raise ProviderError(f"Cannot read the calendar file {path} ({exc.strerror or exc}); "
                                "check providers.calendar_ics in settings.") from None
        return cls.from_bytes(data, tz, source=str(path))

    @classmethod
    def from_bytes(cls, data: bytes, tz: tzinfo, *, source: str = "calendar") -> "EventCalendar":
        import icalendar
        try:
            calendar = icalendar.Calendar.from_ical(data)
            components = list(calendar.walk("VEVENT"))
            return cls(_build_events(components, tz), tz)
        except (ValueError, KeyError, TypeError) as exc:
            raise ProviderError(f"{source} is not a readable iCalendar file ({exc}).") from None

    def between(self, start: datetime, end: datetime) -> list[Occurrence]:
        """Occurrences overlapping [start, end), sorted by start."""
        found = []
        for event in self._events:
            for begin in self._starts_between(event, start - event.duration, end):
                occurrence = event.occurrence(begin, self._tz)
                if occurrence.start < end and (occurrence.end > start or occurrence.start >= start):
                    found.append(occurrence)
        return sorted(found, key=lambda o: (o.start, o.title))

    def next_after(self, moment: datetime) -> Occurrence | None:
        """The first occurrence starting at or after `moment`."""
        starts = []
        for event in self._events:
            if event.rules is None:
                if event.start >= moment:
                    starts.append(event.occurrence(event.start, self._tz))
                continue
            begin = event.rules.after(moment, inc=True)
            if begin is not None:
                starts.append(event.occurrence(begin, self._tz))
        return min(starts, key=lambda o: (o.start, o.title), default=None)

    def at(self, moment: datetime) -> list[Occurrence]:
        """Occurrences under way at `moment`."""
        return [o for o in self.between(moment, moment + timedelta(seconds=1)) if o.covers(moment)]

    @staticmethod
    def _starts_between(event: _Event, start: datetime, end: datetime) -> list[datetime]:
        if event.rules is None:
            return [event.start] if start <= event.start < end else []
        return list(event.rules.between(start, end, inc=True))


class CalendarCache:
    """The parsed calendar of one file, reparsed only when the file changes (mtime or size).

    Parsing is ~1 ms per event with icalendar; answering from parsed events takes a few ms."""

    def __init__(self):
        self._lock = threading.Lock()
        self._key: tuple | None = None
        self._calendar: EventCalendar | None = None

    def load(self, path: str | Path, tz: tzinfo) -> EventCalendar:
        resolved = Path(path).expanduser()
        try:
            stat = resolved.stat()
        except OSError:
            return EventCalendar.from_file(resolved, tz)     # raises the user-facing error
        key = (str(resolved.resolve()), stat.st_mtime_ns, stat.st_size, str(tz))
        with self._lock:
            if key != self._key:
                self._calendar, self._key = EventCalendar.from_file(resolved, tz), key
            return self._calendar


def _build_events(components, tz: tzinfo) -> list[_Event]:
    overrides = [c for c in components if c.get("RECURRENCE-ID") is not None]
    moved = {(str(c.get("UID")), _as_aware(c.decoded("RECURRENCE-ID"), tz)) for c in overrides}
    events = []
    for component in components:
        if component.get("RECURRENCE-ID") is None:
            event = _base_event(component, tz)
            if event.rules is not None:
                uid = str(component.get("UID"))
                for moved_uid, moved_start in moved:
                    if moved_uid == uid:
                        event.rules.exdate(moved_start)
        else:
            event = _base_event(component, tz, allow_rules=False)
        if str(component.get("STATUS", "")).upper() != "CANCELLED":
            events.append(event)
    return events


def _base_event(component, tz: tzinfo, *, allow_rules: bool = True) -> _Event:
    if component.get("DTSTART") is None:
        raise ValueError(f"event {component.get('SUMMARY', '?')!r} has no DTSTART")
    raw_start = component.decoded("DTSTART")
    is_all_day = not isinstance(raw_start, datetime)
    start = _as_aware(raw_start, tz)
    event = _Event(
        title=str(component.get("SUMMARY", "(untitled)")),
        start=start,
        duration=_duration(component, raw_start, start, tz),
        is_all_day=is_all_day,
        is_busy=str(component.get("TRANSP", "OPAQUE")).upper() != "TRANSPARENT",
        location=str(component.get("LOCATION", "")),
    )
    if allow_rules and (component.get("RRULE") is not None or component.get("RDATE") is not None):
        event.rules = _rules(component, start, tz)
    return event


def _duration(component, raw_start, start: datetime, tz: tzinfo) -> timedelta:
    if component.get("DTEND") is not None:
        return max(_as_aware(component.decoded("DTEND"), tz) - start, timedelta(0))
    if component.get("DURATION") is not None:
        return component.decoded("DURATION")
    return timedelta(days=1) if not isinstance(raw_start, datetime) else timedelta(0)


def _rules(component, start: datetime, tz: tzinfo):
    from dateutil.rrule import rruleset, rrulestr
    rules = rruleset()
    for recur in _as_list(component.get("RRULE")):
        rules.rrule(rrulestr(_rule_text(recur, tz), dtstart=start))
    for moment in _dates(component.get("RDATE"), tz):
        rules.rdate(moment)
    for moment in _dates(component.get("EXDATE"), tz):
        rules.exdate(moment)
    return rules


def _rule_text(recur, tz: tzinfo) -> str:
    """The RRULE as text dateutil accepts: UNTIL in UTC, since DTSTART is always aware here."""
    from icalendar.prop import vRecur
    recur = vRecur(recur)
    if "UNTIL" in recur:
        until = recur["UNTIL"][0]
        if not isinstance(until, datetime):
            until = datetime.combine(until, time(23, 59, 59))
        recur["UNTIL"] = [_as_aware(until, tz).astimezone(_utc())]
    return recur.to_ical().decode()


def _dates(prop, tz: tzinfo) -> list[datetime]:
    found = []
    for value in _as_list(prop):
        for item in getattr(value, "dts", []):
            moment = item.dt[0] if isinstance(item.dt, tuple) else item.dt   # RDATE periods: their start
            found.append(_as_aware(moment, tz))
    return found


def _as_list(value) -> list:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def _as_aware(value: date | datetime, tz: tzinfo) -> datetime:
    if not isinstance(value, datetime):
        return datetime.combine(value, time(0), tzinfo=tz)
    return value if value.tzinfo is not None else value.replace(tzinfo=tz)


def _utc():
    from datetime import timezone
    return timezone.utc
