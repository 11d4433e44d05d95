"""The mail provider against IMAP servers that misbehave: one that trickles its greeting, one whose STATUS
reply would make a backtracking regex run for minutes, one that announces an enormous literal. Each check
ends, within a generous bound, in an answer or an error that says what was wrong; none falls through to
the model.

The servers are scripted plain-IMAP servers on 127.0.0.1 (tests/fixtures/imap_server.py), since dovecot
cannot be made to misbehave; the client side is the real provider over real TCP. The bounds are far below
what these servers cost a per-read timeout, a backtracking regex or an unbounded read (30-120 s, or a
MemoryError)."""

from __future__ import annotations

import pytest

import time

from deskeye.ask.providers import QuickAnswerer
from deskeye.settings import ProviderSettings, Settings

pytestmark = [pytest.mark.subprocess]

PASSWORD_ENV = "DESKEYE_TEST_IMAP_PASSWORD"


def scripted_settings(server, monkeypatch, timeout_s: float) -> ProviderSettings:
    monkeypatch.setenv(PASSWORD_ENV, "pw")
    return ProviderSettings(imap_host="127.0.0.1", imap_port=server.port, imap_user="bob", imap_tls=False,
                            imap_password_env=PASSWORD_ENV, imap_timeout_s=timeout_s)


def timed_ask(settings: ProviderSettings, query: str = "any new mail?"):
    started = time.monotonic()
    answer = QuickAnswerer(Settings(providers=settings)).answer(query)
    return answer, time.monotonic() - started


@pytest.mark.slow
def test_a_trickled_greeting_runs_out_of_one_deadline_for_the_whole_check(scripted_imap, monkeypatch):
    server = scripted_imap(greeting=b"* OK " + b"." * 22, byte_interval_s=1.0)   # one byte a second
    answer, elapsed = timed_ask(scripted_settings(server, monkeypatch, timeout_s=2))
    assert answer.is_error and answer.text == f"The IMAP server 127.0.0.1:{server.port} did not answer within 2 s."
    assert elapsed < 10


def test_a_status_line_of_100000_parentheses_is_read_in_one_pass(scripted_imap, monkeypatch):
    parens = b'* STATUS "INBOX" (' + b"(" * 100_000
    server = scripted_imap(status_reply=parens + b"\r\n")
    answer, elapsed = timed_ask(scripted_settings(server, monkeypatch, timeout_s=5))
    assert elapsed < 10
    assert answer.is_error and "no UNSEEN count in the STATUS reply" in answer.text
    assert len(answer.text) < 600                       # the reply is quoted, not pasted whole
    # The same line ending in a count is answered.
    counted = scripted_imap(status_reply=parens + b"UNSEEN 4)\r\n")
    answer, elapsed = timed_ask(scripted_settings(counted, monkeypatch, timeout_s=5))
    assert (answer.text, answer.is_error) == ("You have 4 unread emails in INBOX (bob).", False)
    assert elapsed < 10


def test_a_literal_of_99999999999_bytes_is_refused(scripted_imap, monkeypatch):
    server = scripted_imap(status_reply=b"* STATUS {99999999999}\r\n")
    answer, elapsed = timed_ask(scripted_settings(server, monkeypatch, timeout_s=5))
    assert answer is not None, "fell through to the model"
    assert answer.is_error and answer.text.startswith(
        f"The IMAP server 127.0.0.1:{server.port} sent a reply DeskEye does not accept: "
        "a literal of 99,999,999,999 bytes (at most 65,536 are read).")
    assert elapsed < 10


def test_the_status_reply_is_parsed_by_hand():
    from deskeye.ask.providers.mail import unseen_in_status
    assert unseen_in_status(b'"INBOX" (MESSAGES 5 UNSEEN 3)') == 3
    assert unseen_in_status(b'"Old (2019)" (UNSEEN 0 MESSAGES 9)') == 0
    assert unseen_in_status(b'"INBOX" (MESSAGES 5)') is None
    assert unseen_in_status(b'"INBOX" (' + b"(" * 100_000) is None
