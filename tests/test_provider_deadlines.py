"""Quick answers never hang: small hostile .ics files are answered (or refused with a readable error) in
bounded time, and a provider that is slow for any reason never holds its caller past the deadline.

The calendars are real files read by the real provider. Each bound is generous (the shared machine is
noisy) and still far below what these inputs cost when recurrences are stepped through from DTSTART
(20-90 s and more)."""

from __future__ import annotations

import threading
import time
from datetime import datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from deskeye.ask.providers import QuickAnswer, QuickAnswerer
from deskeye.ask.providers import clock as clock_provider
from deskeye.settings import ProviderSettings, Settings

BERLIN = ZoneInfo("Europe/Berlin")
NOW = datetime(2025, 6, 4, 14, 5, tzinfo=BERLIN)          # a Wednesday afternoon
MAX_ANSWER_S = 10.0


def ics(*event_lines: str) -> bytes:
    """A one-event calendar, CRLF lines, as a calendar app exports it."""
    lines = ["BEGIN:VCALENDAR", "VERSION:2.0", "PRODID:-//t//EN", "BEGIN:VEVENT", "UID:e@t", *event_lines,
             "END:VEVENT", "END:VCALENDAR"]
    return "".join(line + "\r\n" for line in lines).encode()


# The trial's 174-byte file: an event repeating every second since 2020.
SECONDLY = ics("SUMMARY:Pulse", "DTSTART:20200101T000000Z", "DURATION:PT1S", "RRULE:FREQ=SECONDLY")
MINUTELY = ics("SUMMARY:Ping", "DTSTART:20200101T000000Z", "DURATION:PT1M", "RRULE:FREQ=MINUTELY")
NEVER = ics("SUMMARY:Feb 30 review", "DTSTART:20200101T090000Z", "DURATION:PT1H",
            "RRULE:FREQ=DAILY;BYMONTH=2;BYMONTHDAY=30")
YEAR_9999 = ics("SUMMARY:Far future", "DTSTART:99991231T230000Z", "DTEND:99991231T235959Z")
HUGE_DURATION = ics("SUMMARY:Forever", "DTSTART:20250604T150000Z", "DURATION:P99999999W")
BROKEN_RULE = ics("SUMMARY:Odd hours", "DTSTART:20250604T150000Z", "RRULE:FREQ=DAILY;BYHOUR=99")


def answer_within(answerer: QuickAnswerer, query: str, now: datetime = NOW,
                  limit_s: float = MAX_ANSWER_S) -> tuple[QuickAnswer | None, float]:
    """The answer and how long it took, failing if the caller is held longer than `limit_s`.

    The call runs on a daemon thread so that a provider that never returns fails the test at the limit
    instead of hanging the test run."""
    result: list = []
    started = time.monotonic()
    thread = threading.Thread(target=lambda: result.append(answerer.answer(query, now=now)), daemon=True)
    thread.start()
    thread.join(limit_s)
    elapsed = time.monotonic() - started
    assert not thread.is_alive(), f"{query!r} was not answered within {limit_s:g} s"
    return result[0], elapsed


@pytest.fixture
def calendar(tmp_path):
    """Writes `data` as an .ics file and returns an answerer reading it, with the file's path."""
    def make(data: bytes, name: str = "work.ics") -> tuple[QuickAnswerer, Path]:
        path = tmp_path / name
        path.write_bytes(data)
        return QuickAnswerer(Settings(providers=ProviderSettings(calendar_ics=str(path)))), path
    return make


# ---------------------------------------------------------------- calendar


def test_an_event_every_second_since_2020_gives_the_next_one(calendar):
    assert len(SECONDLY) == 174
    answerer, path = calendar(SECONDLY)
    answer, elapsed = answer_within(answerer, "when is my next meeting")
    assert (answer.provider, answer.is_error) == ("calendar", False), answer
    assert answer.text == "Now: 'Pulse' until 14:05. Next: 'Pulse' today 14:05–14:05 (in 0 min)."
    assert elapsed < MAX_ANSWER_S
    # A whole day of it is more than one question may work out: refused, naming the file and the event.
    answer, _ = answer_within(answerer, "what's on my calendar tomorrow")
    assert answer.is_error and "repeats too often" in answer.text
    assert str(path) in answer.text and "'Pulse'" in answer.text and "FREQ=SECONDLY" in answer.text


def test_an_event_every_minute_since_2020_is_listed(calendar):
    answerer, _ = calendar(MINUTELY)
    answer, _ = answer_within(answerer, "when is my next meeting")
    assert answer.text == "Now: 'Ping' until 14:06. Next: 'Ping' today 14:06–14:07 (in 1 min)."
    answer, _ = answer_within(answerer, "what's on my calendar tomorrow")
    assert answer.text == ("Tomorrow: 00:00–00:01 Ping; 00:01–00:02 Ping; 00:02–00:03 Ping; 00:03–00:04 Ping; "
                           "00:04–00:05 Ping; 00:05–00:06 Ping (+1434 more).")
    answer, _ = answer_within(answerer, "am I free at 4pm")
    assert answer.text == "No, at 16:00 today you have 'Ping' (16:00–16:01); free from tomorrow 16:01."


def test_a_rule_that_never_occurs_is_answered_quickly(calendar):
    answerer, _ = calendar(NEVER)
    for query, expected in [("when is my next meeting", "No upcoming events in your calendar."),
                            ("am I free at 4pm", "Yes, you're free at 16:00 today."),
                            ("what's on my calendar tomorrow", "Nothing in your calendar for tomorrow.")]:
        answer, elapsed = answer_within(answerer, query)
        assert (answer.text, answer.is_error) == (expected, False)
        assert elapsed < MAX_ANSWER_S


def test_the_never_occurring_event_still_happens_once_at_its_start(calendar):
    """RFC 5545: DTSTART is the first instance even when the rule never matches."""
    answerer, _ = calendar(NEVER)
    answer, _ = answer_within(answerer, "next meeting?", now=datetime(2019, 12, 31, 12, 0, tzinfo=BERLIN))
    assert answer.text == "Next: 'Feb 30 review' tomorrow 10:00–11:00 (in 22 h)."


@pytest.mark.parametrize("data, event, problem", [
    (YEAR_9999, "'Far future'", "the year 9999"),
    (HUGE_DURATION, "'Forever'", "lasts 699,999,993 days"),
    (BROKEN_RULE, "'Odd hours'", "RRULE:FREQ=DAILY;BYHOUR=99"),
])
def test_bad_dates_are_a_readable_error_naming_the_file_and_the_event(calendar, data, event, problem):
    answerer, path = calendar(data)
    for query in ("when is my next meeting", "am I free at 4pm"):
        answer, _ = answer_within(answerer, query)
        assert answer is not None, "fell through to the model"
        assert (answer.provider, answer.is_error) == ("calendar", True)
        assert str(path) in answer.text and event in answer.text and problem in answer.text
        assert "Correct or delete that event in your calendar app." in answer.text


# ---------------------------------------------------------------- the dispatcher


@pytest.fixture
def stuck_clock(monkeypatch):
    """The clock provider made to hang until released (a stand-in for any provider stuck on its source):
    a real provider can no longer be made slow by its input, which is what the calendar tests show."""
    release, returned = threading.Event(), threading.Event()
    calls: list[str] = []

    def hanging(query, ctx):
        calls.append(query)
        release.wait(30)
        returned.set()
        return "late answer"

    monkeypatch.setattr(clock_provider, "answer", hanging)
    yield release, returned, calls
    release.set()


def with_deadline(seconds: float) -> Settings:
    return Settings(providers=ProviderSettings(quick_answer_timeout_s=seconds))


@pytest.mark.slow
def test_a_stuck_provider_answers_an_error_at_its_deadline(stuck_clock, monkeypatch):
    release, returned, calls = stuck_clock
    answerer = QuickAnswerer(with_deadline(0.5))
    answer, elapsed = answer_within(answerer, "what time is it")
    assert elapsed < 5
    assert (answer.provider, answer.is_error) == ("clock", True)
    assert answer.text.startswith("The clock did not answer within 0.5 s;")
    zh, _ = answer_within(answerer, "现在几点了")
    assert zh.is_error and "时钟" in zh.text
    # The stuck call is still the only one in flight: a second question is not queued behind it.
    assert calls == ["what time is it"]
    assert "still busy with an earlier question" in answer_within(answerer, "what's the time?")[0].text
    # Once it has finished, the provider answers again (on a thread of its own, not the caller's): the
    # next question waits, within its own deadline, for the earlier call to end.
    callers: set[str] = set()

    def named(query, ctx):
        callers.add(threading.current_thread().name)
        return "14:05"

    monkeypatch.setattr(clock_provider, "answer", named)
    release.set()
    assert returned.wait(10)
    again, _ = answer_within(answerer, "what time is it")
    assert (again.text, again.is_error) == ("14:05", False)
    assert callers == {"deskeye-provider-clock"}


def test_other_providers_answer_while_one_is_stuck(stuck_clock):
    answerer = QuickAnswerer(with_deadline(0.5))
    answer_within(answerer, "what time is it")
    answer, elapsed = answer_within(answerer, "how much RAM am I using")
    assert (answer.provider, answer.is_error) == ("system", False) and answer.text.startswith("Memory:")
    assert elapsed < 5
