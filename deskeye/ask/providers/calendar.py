"""Calendar: "when is my next meeting", "am I free at 4pm", "下午4点有空吗", "今天下午有会吗".

Reads `providers.calendar_ics` (an exported .ics file), parsed once and again whenever the file
changes (so an edited or re-synced file is seen at the next question). Three kinds of answer:
  a time is named ("at 4pm", "三点半")      -> free or busy then (the next free time if busy);
  a day or part of day ("this afternoon")   -> that span's events;
  otherwise                                 -> what is on now and the next event.
"""

from __future__ import annotations

from datetime import datetime, time, timedelta

from deskeye.errors import ProviderError
from deskeye.ask.providers.base import QueryContext, clock_text, day_name, has_text, has_word, minutes_text
from deskeye.ask.providers.ics import CalendarCache, EventCalendar, Occurrence
from deskeye.ask.providers.timeparse import at_local, parse_day, parse_day_part, parse_time_of_day

NAME = "calendar"
LABEL, LABEL_ZH = "The calendar", "日历"     # who "did not answer" when it is too slow
_EN = ("meeting", "meetings", "calendar", "schedule", "scheduled", "appointment", "appointments", "agenda",
       "event", "events", "call", "free", "busy", "available", "o'clock")
_ZH = ("会议", "开会", "有会", "个会", "日程", "日历", "安排", "有空", "忙吗", "忙不忙", "有事", "约会", "预约",
       "空闲")
_MAX_LISTED = 6
_CACHE = CalendarCache()


def matches(query: str) -> bool:
    return has_word(query, _EN) or has_text(query, _ZH)


def answer(query: str, ctx: QueryContext) -> str | None:
    path = ctx.settings.calendar_ics
    if not path:
        raise ProviderError("No calendar is configured: set providers.calendar_ics in settings.toml to the "
                            "path of an .ics file (your calendar app can export or sync one).")
    calendar = _CACHE.load(path, ctx.now.tzinfo)
    now = ctx.now
    day = parse_day(query, now.date())
    when = parse_time_of_day(query)
    if when is not None:
        return _free_at(calendar, _moment(day, when, now), ctx)
    part = parse_day_part(query)
    if day is not None or part is not None:
        return _agenda(calendar, day or now.date(), part, ctx)
    return _next(calendar, ctx)


def _moment(day, when: time, now: datetime) -> datetime:
    """The asked time; with no day named, a time already past today means tomorrow."""
    if day is not None:
        return at_local(day, when, now.tzinfo)
    moment = at_local(now.date(), when, now.tzinfo)
    return moment if moment >= now - timedelta(minutes=30) else moment + timedelta(days=1)


def _free_at(calendar: EventCalendar, moment: datetime, ctx: QueryContext) -> str:
    label = f"{clock_text(moment)} {day_name(moment.date(), ctx.now.date(), ctx.lang)}"
    busy = [o for o in calendar.at(moment) if o.is_busy]
    if busy:
        names_en = ", ".join(f"'{o.title}' ({_span(o, ctx)})" for o in busy)
        names_zh = "、".join(f"「{o.title}」({_span(o, ctx)})" for o in busy)
        free_from = _free_from(calendar, max(o.end for o in busy))
        until = clock_text(free_from)
        if free_from.date() != moment.date():
            until = f"{day_name(free_from.date(), ctx.now.date(), ctx.lang)} {until}"
        return ctx.say(f"No, at {label} you have {names_en}; free from {until}.",
                       f"{label} 没空:{names_zh},{until} 之后有空。")
    later = [o for o in calendar.between(moment, _end_of_day(moment)) if o.is_busy and o.start > moment]
    text = ctx.say(f"Yes, you're free at {label}.", f"{label} 有空。")
    if later:
        first = later[0]
        text += ctx.say(f" Next that day: '{first.title}' at {clock_text(first.start)}.",
                        f"当天下一个:{clock_text(first.start)}「{first.title}」。")
    return text


def _free_from(calendar: EventCalendar, moment: datetime) -> datetime:
    """The end of back-to-back busy events starting from `moment` (at most a day's worth, in one query)."""
    horizon = moment + timedelta(days=1)
    for o in calendar.between(moment, horizon):          # sorted by start
        if o.is_busy and o.start <= moment < o.end:
            moment = o.end
    return min(moment, horizon)


def _agenda(calendar: EventCalendar, day, part, ctx: QueryContext) -> str:
    tz = ctx.now.tzinfo
    start = at_local(day, part.start if part else time(0), tz)
    end = at_local(day, part.end, tz) if part else _end_of_day(start)
    if day == ctx.now.date():
        start = max(start, ctx.now)
    label = day_name(day, ctx.now.date(), ctx.lang)
    found = calendar.between(start, end) if start < end else []
    if not found:
        return ctx.say(f"Nothing in your calendar for {label}{' ' + _part_en(part) if part else ''}.",
                       f"{label}{_part_zh(part)}没有日程。")
    items = [f"{_span(o, ctx)} {o.title}" for o in found[:_MAX_LISTED]]
    more = len(found) - len(items)
    tail_en, tail_zh = (f" (+{more} more)", f"(另有 {more} 项)") if more > 0 else ("", "")
    return ctx.say(f"{label.capitalize()}{' ' + _part_en(part) if part else ''}: {'; '.join(items)}{tail_en}.",
                   f"{label}{_part_zh(part)}:{';'.join(items)}{tail_zh}。")


def _next(calendar: EventCalendar, ctx: QueryContext) -> str:
    now = ctx.now
    current = [o for o in calendar.at(now) if not o.is_all_day]
    upcoming = calendar.next_after(now + timedelta(seconds=1))
    parts = []
    for o in current:
        parts.append(ctx.say(f"Now: '{o.title}' until {clock_text(o.end)}.",
                             f"正在进行:「{o.title}」,到 {clock_text(o.end)}。"))
    if upcoming is None:
        parts.append(ctx.say("No upcoming events in your calendar.", "日历里没有接下来的日程。"))
    else:
        parts.append(_describe_next(upcoming, ctx))
    return " ".join(parts) if ctx.lang == "en" else "".join(parts)


def _describe_next(o: Occurrence, ctx: QueryContext) -> str:
    day = day_name(o.start.date(), ctx.now.date(), ctx.lang)
    where = f" @ {o.location}" if o.location else ""
    if o.is_all_day:
        return ctx.say(f"Next: '{o.title}' {day} (all day){where}.", f"下一个:「{o.title}」{day}(全天){where}。")
    minutes = int((o.start - ctx.now).total_seconds() // 60)
    is_soon = minutes < 24 * 60
    soon_en = f" (in {minutes_text(minutes, 'en')})" if is_soon else ""
    soon_zh = f"({minutes_text(minutes, 'zh')}后)" if is_soon else ""
    return ctx.say(f"Next: '{o.title}' {day} {_span(o, ctx)}{soon_en}{where}.",
                   f"下一个:「{o.title}」{day} {_span(o, ctx)}{soon_zh}{where}。")


def _span(o: Occurrence, ctx: QueryContext) -> str:
    if o.is_all_day:
        return ctx.say("all day", "全天")
    if o.end <= o.start:
        return clock_text(o.start)
    return f"{clock_text(o.start)}–{clock_text(o.end)}"


def _end_of_day(moment: datetime) -> datetime:
    return at_local(moment.date() + timedelta(days=1), time(0), moment.tzinfo)


def _part_en(part) -> str:
    return {12: "morning", 18: "afternoon"}.get(part.end.hour, "evening") if part else ""


def _part_zh(part) -> str:
    return {12: "上午", 18: "下午"}.get(part.end.hour, "晚上") if part else ""
