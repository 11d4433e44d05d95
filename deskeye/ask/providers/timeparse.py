"""Time words in a query, English and Chinese: "at 4pm", "3:30", "noon", "下午4点", "三点半", "明天", "周一".

Only what the quick providers need: which day (relative to now) and which time of day. A bare hour
from 1 to 7 with no am/pm ("free at 4?") is read as afternoon — nobody books 4 a.m. meetings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta

_ZH_DIGITS = {"零": 0, "〇": 0, "一": 1, "二": 2, "两": 2, "三": 3, "四": 4, "五": 5, "六": 6, "七": 7,
              "八": 8, "九": 9}
_EN_WEEKDAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]
_ZH_WEEKDAYS = "一二三四五六日天"   # 周日 / 星期天 both mean Sunday

_EN_TIME = re.compile(
    r"(?:\bat\s+(?P<at_h>\d{1,2})(?::(?P<at_m>\d{2}))?(?!\d)"
    r"|\b(?P<h>\d{1,2})(?::(?P<m>\d{2}))?\s*(?P<ampm>a\.?m\.?|p\.?m\.?|o'?clock)"
    r"|\b(?P<hh>\d{1,2}):(?P<mm>\d{2})\b)"
    r"(?:\s*(?P<ampm2>a\.?m\.?|p\.?m\.?)(?![a-z]))?",
    re.I)
_ZH_NUM = r"(?:\d{1,2}|[零〇一二两三四五六七八九十]{1,3})"
_ZH_TIME = re.compile(
    rf"(?P<part>凌晨|早上|早晨|上午|中午|下午|傍晚|晚上|今晚)?\s*(?P<h>{_ZH_NUM})\s*(?:点|點|时|時|[:：])\s*"
    rf"(?:(?P<half>半)|(?P<q1>一刻)|(?P<q3>三刻)|(?P<m>{_ZH_NUM})\s*分?)?")
_PM_PARTS = ("下午", "傍晚", "晚上", "今晚")


@dataclass(frozen=True)
class DayPart:
    """A span of one day named in a query ("this afternoon", "下午"): [start, end) as times."""
    start: time
    end: time


_EN_PARTS = {"morning": DayPart(time(0), time(12)), "afternoon": DayPart(time(12), time(18)),
             "evening": DayPart(time(18), time(23, 59, 59)), "tonight": DayPart(time(18), time(23, 59, 59))}
_ZH_PARTS = {"上午": _EN_PARTS["morning"], "早上": _EN_PARTS["morning"], "下午": _EN_PARTS["afternoon"],
             "晚上": _EN_PARTS["evening"], "今晚": _EN_PARTS["evening"]}


def zh_number(text: str) -> int:
    """'4' -> 4, '十二' -> 12, '二十' -> 20, '三' -> 3."""
    if text.isdigit():
        return int(text)
    if "十" in text:
        tens, _, ones = text.partition("十")
        return (_ZH_DIGITS.get(tens, 1) if tens else 1) * 10 + (_ZH_DIGITS.get(ones, 0) if ones else 0)
    return _ZH_DIGITS[text]


def parse_day(query: str, today: date) -> date | None:
    """The day a query names: today/tomorrow/the day after, or a weekday (the next one, today included)."""
    q = query.casefold()
    if re.search(r"\b(day after tomorrow)\b", q) or "后天" in q:
        return today + timedelta(days=2)
    if re.search(r"\b(tomorrow|tmrw|tmr|tomorow)\b", q) or "明天" in q or "明日" in q:
        return today + timedelta(days=1)
    if re.search(r"\b(today|tonight|this (morning|afternoon|evening))\b", q) or any(
            w in q for w in ("今天", "今晚", "今日")):
        return today
    for index, name in enumerate(_EN_WEEKDAYS):
        if re.search(rf"\b{name}\b", q):
            return today + timedelta(days=(index - today.weekday()) % 7)
    match = re.search(rf"(?:周|星期|礼拜)([{_ZH_WEEKDAYS}])", query)
    if match:
        index = min(_ZH_WEEKDAYS.index(match.group(1)), 6)
        return today + timedelta(days=(index - today.weekday()) % 7)
    return None


def parse_time_of_day(query: str) -> time | None:
    """The clock time a query names, or None."""
    q = query.casefold()
    if re.search(r"\b(noon|midday)\b", q) or re.search(rf"中午(?!\s*{_ZH_NUM})", query):
        return time(12)
    if re.search(r"\bmidnight\b", q):
        return time(0)
    return _zh_time(query) or _en_time(q)


def _en_time(q: str) -> time | None:
    match = _EN_TIME.search(q)
    if not match:
        return None
    hour = int(match.group("at_h") or match.group("h") or match.group("hh"))
    minute = int(match.group("at_m") or match.group("m") or match.group("mm") or 0)
    marker = (match.group("ampm") or match.group("ampm2") or "").replace(".", "")
    if marker.startswith("p") and hour < 12:
        hour += 12
    elif marker.startswith("a") and hour == 12:
        hour = 0
    elif not marker.startswith(("a", "p")) and 1 <= hour <= 7:
        hour += 12   # "free at 4?" means the afternoon
    return _valid_time(hour, minute)


def _zh_time(query: str) -> time | None:
    match = _ZH_TIME.search(query)
    if not match:
        return None
    hour = zh_number(match.group("h"))
    minute = 30 if match.group("half") else 15 if match.group("q1") else 45 if match.group("q3") else 0
    if match.group("m"):
        minute = zh_number(match.group("m"))
    part = match.group("part") or ""
    if part in _PM_PARTS and hour < 12:
        hour += 12
    elif part == "中午" and hour < 6:
        hour += 12
    elif not part and 1 <= hour <= 7:
        hour += 12
    return _valid_time(hour, minute)


def _valid_time(hour: int, minute: int) -> time | None:
    return time(hour, minute) if 0 <= hour <= 23 and 0 <= minute <= 59 else None


def parse_day_part(query: str) -> DayPart | None:
    q = query.casefold()
    for word, part in _EN_PARTS.items():
        if re.search(rf"\b{word}\b", q):
            return part
    for word, part in _ZH_PARTS.items():
        if word in query:
            return part
    return None


def at_local(day: date, when: time, tz) -> datetime:
    return datetime.combine(day, when, tzinfo=tz)
