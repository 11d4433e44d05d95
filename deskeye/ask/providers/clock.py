"""Clock and date: "what time is it", "what's the date tomorrow", "现在几点了", "今天星期几"."""

from __future__ import annotations

from datetime import datetime

from deskeye.ask.providers.base import QueryContext, has_text, has_word
from deskeye.ask.providers.timeparse import parse_day

NAME = "clock"
LABEL, LABEL_ZH = "The clock", "时钟"     # who "did not answer" when it is too slow
_EN = ("time", "date", "day", "days", "month", "year", "clock", "today", "tomorrow", "yesterday", "how late",
       "monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday", "weekday")
_ZH = ("几点", "时间", "几号", "日期", "星期", "周几", "礼拜", "几月", "日子", "钟")
_ZH_WEEKDAYS = "一二三四五六日"


def matches(query: str) -> bool:
    return has_word(query, _EN) or has_text(query, _ZH)


def answer(query: str, ctx: QueryContext) -> str | None:
    now = ctx.now
    day = parse_day(query, now.date())
    if day is not None and day != now.date():
        return _other_day(day, now, ctx)
    zone = now.tzname() or ""
    if ctx.lang == "zh":
        return f"现在是 {_zh_date(now)} {now:%H:%M}" + (f"({zone})" if zone else "") + "。"
    return f"It's {now:%H:%M}" + (f" {zone}" if zone else "") + f" on {_en_date(now)}."


def _other_day(day, now: datetime, ctx: QueryContext) -> str:
    offset = (day - now.date()).days
    when = {1: ("Tomorrow", "明天"), -1: ("Yesterday", "昨天"), 2: ("The day after tomorrow", "后天")}
    en, zh = when.get(offset, ("That day", "那天"))
    moment = datetime.combine(day, now.timetz())
    return ctx.say(f"{en} is {_en_date(moment)}.", f"{zh}是 {_zh_date(moment)}。")


def _en_date(moment: datetime) -> str:
    return f"{moment:%A}, {moment.day} {moment:%B %Y}"


def _zh_date(moment: datetime) -> str:
    return f"{moment.year}年{moment.month}月{moment.day}日 星期{_ZH_WEEKDAYS[moment.weekday()]}"
