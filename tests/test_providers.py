"""Quick answers from real sources without any model: a calendar .ics written here, the clock, psutil,
and the app's screen memory; queries no provider can answer fall through (None)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from datetime import datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import psutil
import pytest

from deskeye.ask.providers import QuickAnswerer, ScreenMemory, pick_provider
from deskeye.ask.providers import clock as clock_provider
from deskeye.ask.providers.ics import EventCalendar
from deskeye.ask.router import find_data_file, load_examples
from deskeye.settings import package_rules_dir, ProviderSettings, Settings
from deskeye.prompt import Description

pytestmark = [pytest.mark.subprocess]

BERLIN = ZoneInfo("Europe/Berlin")
NOW = datetime(2025, 6, 4, 14, 5, tzinfo=BERLIN)          # a Wednesday afternoon

ICS = """BEGIN:VCALENDAR
VERSION:2.0
PRODID:-//DeskEye tests//EN
BEGIN:VEVENT
UID:review@test
SUMMARY:Design review
DTSTART;TZID=Europe/Berlin:20250604T153000
DTEND;TZID=Europe/Berlin:20250604T163000
LOCATION:Room 2
END:VEVENT
BEGIN:VEVENT
UID:ny@test
SUMMARY:Call with NY
DTSTART:20250604T150000Z
DTEND:20250604T153000Z
END:VEVENT
BEGIN:VEVENT
UID:cancelled@test
SUMMARY:Cancelled sync
STATUS:CANCELLED
DTSTART;TZID=Europe/Berlin:20250604T180000
DTEND;TZID=Europe/Berlin:20250604T190000
END:VEVENT
BEGIN:VEVENT
UID:standup@test
SUMMARY:Standup
DTSTART;TZID=Europe/Berlin:20250602T093000
DTEND;TZID=Europe/Berlin:20250602T094500
RRULE:FREQ=WEEKLY;BYDAY=MO,TU,WE,TH,FR;UNTIL=20250620T000000Z
EXDATE;TZID=Europe/Berlin:20250606T093000
END:VEVENT
BEGIN:VEVENT
UID:standup@test
RECURRENCE-ID;TZID=Europe/Berlin:20250610T093000
SUMMARY:Standup (moved)
DTSTART;TZID=Europe/Berlin:20250610T110000
DTEND;TZID=Europe/Berlin:20250610T111500
END:VEVENT
BEGIN:VEVENT
UID:holiday@test
SUMMARY:Holiday
DTSTART;VALUE=DATE:20250605
DTEND;VALUE=DATE:20250606
TRANSP:TRANSPARENT
END:VEVENT
BEGIN:VEVENT
UID:offsite@test
SUMMARY:Offsite
DTSTART;VALUE=DATE:20250609
DTEND;VALUE=DATE:20250610
END:VEVENT
BEGIN:VEVENT
UID:partner@test
SUMMARY:Partner sync
DTSTART;TZID=America/New_York:20250605T100000
DTEND;TZID=America/New_York:20250605T110000
END:VEVENT
BEGIN:VEVENT
UID:gym@test
SUMMARY:Gym
DTSTART:20250604T070000
DURATION:PT1H
RRULE:FREQ=DAILY;COUNT=3
END:VEVENT
END:VCALENDAR
"""


@pytest.fixture(scope="module")
def calendar_answerer(tmp_path_factory) -> QuickAnswerer:
    path = tmp_path_factory.mktemp("calendar") / "work.ics"
    path.write_text(ICS.replace("\n", "\r\n"), encoding="utf-8")
    return QuickAnswerer(Settings(providers=ProviderSettings(calendar_ics=str(path))))


def ask(answerer: QuickAnswerer, query: str, now: datetime = NOW) -> str:
    answer = answerer.answer(query, now=now)
    assert answer is not None and answer.provider == "calendar" and not answer.is_error, answer
    return answer.text


# ---------------------------------------------------------------- calendar

def test_next_event(calendar_answerer):
    assert ask(calendar_answerer, "when is my next meeting") == \
        "Next: 'Design review' today 15:30–16:30 (in 1 h 25 min) @ Room 2."
    assert ask(calendar_answerer, "下一个会议是什么时候") == \
        "下一个:「Design review」今天 15:30–16:30(1 小时 25 分钟后) @ Room 2。"


def test_next_event_while_one_is_under_way_with_utc_times(calendar_answerer):
    now = datetime(2025, 6, 4, 15, 45, tzinfo=BERLIN)
    assert ask(calendar_answerer, "what's next on my calendar", now) == \
        "Now: 'Design review' until 16:30. Next: 'Call with NY' today 17:00–17:30 (in 1 h 15 min)."


def test_next_all_day_event_and_nothing_left(calendar_answerer):
    sunday_evening = datetime(2025, 6, 8, 20, 0, tzinfo=BERLIN)
    assert ask(calendar_answerer, "next meeting?", sunday_evening) == "Next: 'Offsite' tomorrow (all day)."
    assert ask(calendar_answerer, "next meeting?", datetime(2026, 1, 1, tzinfo=BERLIN)) == \
        "No upcoming events in your calendar."


def test_busy_and_free_at_a_time(calendar_answerer):
    assert ask(calendar_answerer, "am I free at 4pm") == \
        "No, at 16:00 today you have 'Design review' (15:30–16:30); free from 16:30."
    assert ask(calendar_answerer, "am I free at 5:15pm") == \
        "No, at 17:15 today you have 'Call with NY' (17:00–17:30); free from 17:30."
    assert ask(calendar_answerer, "r u free at 3pm") == \
        "Yes, you're free at 15:00 today. Next that day: 'Design review' at 15:30."
    assert ask(calendar_answerer, "free at 18:00?") == "Yes, you're free at 18:00 today."   # the cancelled one


def test_free_at_in_chinese(calendar_answerer):
    assert ask(calendar_answerer, "下午4点有空吗") == "16:00 今天 没空:「Design review」(15:30–16:30),16:30 之后有空。"
    assert ask(calendar_answerer, "下午三点有空吗") == "15:00 今天 有空。当天下一个:15:30「Design review」。"


def test_recurring_weekly_with_exdate_and_other_timezones(calendar_answerer):
    assert ask(calendar_answerer, "am I free at 9:30 tomorrow") == \
        "No, at 09:30 tomorrow you have 'Standup' (09:30–09:45); free from 09:45."
    assert ask(calendar_answerer, "am I free at 9:30 on friday").startswith("Yes, you're free at 09:30 Fri 6 Jun.")
    # New York 10:00 is Berlin 16:00; the transparent all-day holiday does not make anyone busy.
    assert ask(calendar_answerer, "am I busy at 4pm tomorrow") == \
        "No, at 16:00 tomorrow you have 'Partner sync' (16:00–17:00); free from 17:00."


def test_opaque_all_day_event_blocks_the_day(calendar_answerer):
    assert ask(calendar_answerer, "am I free at 11am on monday") == \
        "No, at 11:00 Mon 9 Jun you have 'Offsite' (all day); free from Tue 10 Jun 00:00."


def test_agenda_for_a_part_of_a_day(calendar_answerer):
    assert ask(calendar_answerer, "今天下午有会吗") == "今天下午:15:30–16:30 Design review;17:00–17:30 Call with NY。"
    assert ask(calendar_answerer, "what's on my calendar tomorrow") == \
        "Tomorrow: all day Holiday; 07:00–08:00 Gym; 09:30–09:45 Standup; 16:00–17:00 Partner sync."
    assert ask(calendar_answerer, "any meetings this evening?") == "Nothing in your calendar for today evening."


def test_expansion_moved_instance_until_and_count():
    calendar = EventCalendar.from_bytes(ICS.encode(), BERLIN)
    day = datetime(2025, 6, 10, tzinfo=BERLIN)
    assert [(o.title, o.start.strftime("%H:%M")) for o in calendar.between(day, day + timedelta(days=1))] == \
        [("Standup (moved)", "11:00")]
    late_june = calendar.between(datetime(2025, 6, 20, tzinfo=BERLIN), datetime(2025, 7, 31, tzinfo=BERLIN))
    assert [o.title for o in late_june] == []                                   # UNTIL 20 June
    gyms = [o for o in calendar.between(datetime(2025, 6, 1, tzinfo=BERLIN), datetime(2025, 7, 1, tzinfo=BERLIN))
            if o.title == "Gym"]
    assert [o.start.day for o in gyms] == [4, 5, 6] and all(o.start.hour == 7 for o in gyms)   # COUNT=3, floating
    standups = [o for o in calendar.between(datetime(2025, 6, 2, tzinfo=BERLIN), datetime(2025, 6, 14, tzinfo=BERLIN))
                if o.title == "Standup"]
    assert [o.start.day for o in standups] == [2, 3, 4, 5, 9, 11, 12, 13]       # minus EXDATE 6, moved 10


def test_an_edited_calendar_file_is_read_again(tmp_path):
    path = tmp_path / "cal.ics"
    path.write_text(ICS, encoding="utf-8")
    answerer = QuickAnswerer(Settings(providers=ProviderSettings(calendar_ics=str(path))))
    assert ask(answerer, "am I free at 3pm").startswith("Yes")
    extra = ("BEGIN:VEVENT\nUID:new@test\nSUMMARY:Urgent call\nDTSTART;TZID=Europe/Berlin:20250604T145000\n"
             "DTEND;TZID=Europe/Berlin:20250604T151500\nEND:VEVENT\nEND:VCALENDAR\n")
    path.write_text(ICS.replace("END:VCALENDAR\n", extra), encoding="utf-8")
    assert ask(answerer, "am I free at 3pm") == \
        "No, at 15:00 today you have 'Urgent call' (14:50–15:15); free from 15:15."


def test_calendar_problems_are_answers_not_failures(tmp_path):
    answer = QuickAnswerer(Settings()).answer("when is my next meeting", now=NOW)
    assert answer.is_error and "providers.calendar_ics" in answer.text
    missing = tmp_path / "nope.ics"
    answer = QuickAnswerer(Settings(providers=ProviderSettings(calendar_ics=str(missing)))).answer("next meeting?")
    assert answer.is_error and str(missing) in answer.text
    broken = tmp_path / "broken.ics"
    broken.write_text("BEGIN:VCALENDAR\nBEGIN:VEVENT\nSUMMARY:x\nEND:VEVENT\nEND:VCALENDAR\n")
    answer = QuickAnswerer(Settings(providers=ProviderSettings(calendar_ics=str(broken)))).answer("next meeting?")
    assert answer.is_error and "not a readable iCalendar file" in answer.text


# ---------------------------------------------------------------- clock

@pytest.mark.parametrize("now", [NOW, datetime(2031, 12, 31, 23, 59, tzinfo=ZoneInfo("Asia/Shanghai"))])
def test_clock_answers_from_the_given_now_in_the_query_language(now):
    answerer = QuickAnswerer(Settings())
    en = answerer.answer("what time is it", now=now)
    assert en.provider == "clock"
    assert en.text == f"It's {now:%H:%M} {now.tzname()} on {now:%A}, {now.day} {now:%B %Y}."
    zh = answerer.answer("现在几点了", now=now).text
    weekday = "一二三四五六日"[now.weekday()]
    assert zh == f"现在是 {now.year}年{now.month}月{now.day}日 星期{weekday} {now:%H:%M}({now.tzname()})。"
    tomorrow = now + timedelta(days=1)
    assert answerer.answer("明天是几号", now=now).text.startswith(
        f"明天是 {tomorrow.year}年{tomorrow.month}月{tomorrow.day}日")


def test_clock_without_injected_now_uses_the_real_clock():
    before = datetime.now().astimezone()
    text = QuickAnswerer(Settings()).answer("what's the time?").text
    after = datetime.now().astimezone()
    assert any(f"{t:%H:%M}" in text for t in (before, after))


# ---------------------------------------------------------------- system

def _number(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not in {text!r}"
    return float(match.group(1))


def test_system_figures_match_psutil():
    answerer = QuickAnswerer(Settings())
    memory = answerer.answer("how much RAM am I using").text
    assert abs(_number(r"Memory: (\d+)% used", memory) - psutil.virtual_memory().percent) <= 5
    total_gib = psutil.virtual_memory().total / 1024 ** 3
    assert abs(_number(r"of ([\d.]+) GiB", memory) - total_gib) <= 0.1
    disk = answerer.answer("how much disk space is left").text
    usage = psutil.disk_usage(str(Path.home()))
    assert abs(_number(r"(\d+)% used", disk) - usage.percent) <= 1
    assert abs(_number(r"([\d.]+) GiB free", disk) - usage.free / 1024 ** 3) <= 0.5
    cpu = answerer.answer("cpu usage").text
    assert 0 <= _number(r"CPU: (\d+)% busy", cpu) <= 100
    assert _number(r"across (\d+) cores", cpu) == psutil.cpu_count()


def test_battery_matches_psutil_or_says_there_is_none():
    text = QuickAnswerer(Settings()).answer("电池还有多少电").text
    battery = psutil.sensors_battery()
    if battery is None:
        assert text == "电池:这台机器上没有检测到电池。"
    else:
        assert abs(_number(r"电池:(\d+)%", text) - battery.percent) <= 2


def test_system_status_lists_every_figure():
    text = QuickAnswerer(Settings()).answer("system status").text
    assert all(word in text for word in ("Battery:", "CPU:", "Memory:", "Disk ("))


# ---------------------------------------------------------------- screen memory

def test_last_seen_answers_from_screen_memory():
    memory = ScreenMemory()
    answerer = QuickAnswerer(Settings(), memory)
    assert answerer.answer("what did you see last time", now=NOW) is None      # nothing yet: falls through
    memory.remember(Description("A terminal with a failing test", ["pytest", "AssertionError"]),
                    at=NOW - timedelta(minutes=4))
    memory.remember(Description("VS Code with main.py open", ["main.py", "Run button"]), at=NOW - timedelta(minutes=2))
    answer = answerer.answer("what was that?", now=NOW)
    assert (answer.provider, answer.text) == (
        "memory", "Last time (2 min ago, 14:03) I saw: VS Code with main.py open. Key items: main.py, Run button.")
    assert answerer.answer("刚才看到了什么", now=NOW).text == \
        "上次(2 分钟前,14:03)看到:VS Code with main.py open。要点:main.py、Run button。"
    assert memory.last() == Description("VS Code with main.py open", ["main.py", "Run button"])


def test_screen_memory_is_thread_safe_and_bounded():
    memory = ScreenMemory(max_items=3)
    barrier = threading.Barrier(8)

    def writer(n: int):
        barrier.wait()
        for i in range(200):
            memory.remember(Description(f"w{n}-{i}", [str(i)]))
            assert memory.last() is not None

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    recent = memory.recent()
    assert len(recent) == 3 and len({s.summary for s in recent}) == 3
    # The very last remember() of all was some writer's final one.
    assert recent[-1].summary.endswith("-199") and memory.last().summary == recent[-1].summary


# ---------------------------------------------------------------- routing to providers

def test_every_quick_query_in_the_router_data_has_a_provider():
    examples = load_examples(find_data_file(package_rules_dir()))
    missing = [e.query for e in examples if e.tier == "quick" and pick_provider(e.query) is None]
    assert missing == []


@pytest.mark.parametrize("query, provider", [
    ("how busy is the CPU right now", "system"), ("how much memory is free", "system"),
    ("what time is my next meeting", "calendar"), ("did anyone email me about the meeting", "mail"),
    ("what was on screen a minute ago", "memory"), ("今天星期几", "clock"), ("内存用了多少", "system"),
])
def test_intent_picks_the_most_specific_provider(query, provider):
    assert pick_provider(query).NAME == provider


def test_unanswerable_quick_query_falls_through():
    answerer = QuickAnswerer(Settings(), ScreenMemory())
    for query in ("what's the weather like", "明天会下雨吗", "", "   "):
        assert answerer.answer(query, now=NOW) is None


def test_a_provider_crash_falls_through_instead_of_failing(monkeypatch, caplog):
    def broken(query, ctx):
        raise RuntimeError("clock exploded")
    monkeypatch.setattr(clock_provider, "answer", broken)
    assert QuickAnswerer(Settings()).answer("what time is it", now=NOW) is None
    assert "clock exploded" in caplog.text


@pytest.mark.slow
def test_quick_answers_need_no_model_worker_or_network(tmp_path):
    """In a fresh interpreter: answering imports no torch/transformers/openai/worker and opens no socket."""
    ics = tmp_path / "c.ics"
    ics.write_text(ICS)
    script = f"""
import json, socket, sys
opened = []
class NoNet(socket.socket):
    def connect(self, address):
        opened.append(str(address)); raise OSError("network disabled in this test")
socket.socket = NoNet
from deskeye.ask.providers import QuickAnswerer, ScreenMemory
from deskeye.settings import ProviderSettings, Settings
from deskeye.prompt import Description
memory = ScreenMemory(); memory.remember(Description("a chart", ["chart"]))
qa = QuickAnswerer(Settings(providers=ProviderSettings(calendar_ics={str(ics)!r})), memory)
queries = ["what time is it", "am I free at 4pm", "battery level?", "刚才看到了什么", "今天几号"]
answers = [qa.answer(q) for q in queries]
heavy = [m for m in ("torch", "transformers", "openai", "inference_worker.server.lifetime", "deskeye.worker.client")
         if m in sys.modules]
print(json.dumps({{"providers": [a.provider for a in answers], "errors": [a.is_error for a in answers],
                  "heavy": heavy, "opened": opened}}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"providers": ["clock", "calendar", "system", "memory", "clock"],
                                       "errors": [False] * 5, "heavy": [], "opened": []}
