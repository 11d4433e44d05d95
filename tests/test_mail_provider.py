"""Unread mail from a REAL IMAP server: dovecot started by the tests on 127.0.0.1 with TLS
(tests/fixtures/imap_server.py). The password never shows up in answers, errors or logs."""

from __future__ import annotations

import logging
import socket
import threading
from dataclasses import replace

import pytest

from deskeye.errors import ProviderError
from deskeye.ask.providers import QuickAnswerer
from deskeye.ask.providers.mail import KEYRING_SERVICE, unread_count
from deskeye.settings import ProviderSettings, Settings

pytestmark = [pytest.mark.subprocess]

PASSWORD_ENV = "DESKEYE_TEST_IMAP_PASSWORD"


@pytest.fixture
def mail_settings(imap_server, monkeypatch) -> ProviderSettings:
    monkeypatch.setenv(PASSWORD_ENV, imap_server.password)
    monkeypatch.setenv("PYTHON_KEYRING_BACKEND", "keyring.backends.null.Keyring")
    return ProviderSettings(imap_host=imap_server.host, imap_port=imap_server.port, imap_user=imap_server.user,
                            imap_password_env=PASSWORD_ENV, imap_ca_file=str(imap_server.ca_file),
                            imap_timeout_s=5.0)


def ask(settings: ProviderSettings, query: str):
    return QuickAnswerer(Settings(providers=settings)).answer(query)


@pytest.fixture
def all_logs(caplog):
    caplog.set_level(logging.DEBUG)
    return caplog


def test_unread_count_equals_the_unseen_messages(mail_settings, imap_server, all_logs):
    assert unread_count(mail_settings) == imap_server.num_unseen
    answer = ask(mail_settings, "any new mail?")
    assert (answer.provider, answer.is_error) == ("mail", False)
    assert answer.text == f"You have {imap_server.num_unseen} unread emails in INBOX ({imap_server.user})."
    assert imap_server.password not in all_logs.text


def test_chinese_question_gets_a_chinese_answer(mail_settings, imap_server):
    answer = ask(mail_settings, "有新邮件吗")
    assert answer.text == f"INBOX 有 {imap_server.num_unseen} 封未读邮件({imap_server.user})。"


@pytest.mark.slow
def test_wrong_password_is_a_clear_error_without_the_password(mail_settings, monkeypatch, all_logs):
    wrong = "not-the-password-\"x\"-42"
    monkeypatch.setenv(PASSWORD_ENV, wrong)
    with pytest.raises(ProviderError) as caught:
        unread_count(mail_settings)
    message = str(caught.value)
    assert "refused" in message and "AUTHENTICATIONFAILED" in message and PASSWORD_ENV in message
    answer = ask(mail_settings, "how many unread emails do I have")
    assert answer.is_error and answer.text == message
    for text in (message, repr(caught.value), all_logs.text):
        assert wrong not in text


def test_untrusted_certificate_names_the_fix(mail_settings):
    answer = ask(replace(mail_settings, imap_ca_file=""), "check my inbox")
    assert answer.is_error and "not trusted" in answer.text and "imap_ca_file" in answer.text


def test_password_from_the_keyring_when_the_variable_is_unset(mail_settings, imap_server, monkeypatch):
    """No Secret Service runs here: a small in-memory backend is installed through keyring's own API."""
    import keyring
    from keyring.backend import KeyringBackend

    class MemoryKeyring(KeyringBackend):
        priority = 1
        stored = {(KEYRING_SERVICE, imap_server.user): imap_server.password}

        def get_password(self, service, username):
            return self.stored.get((service, username))

        def set_password(self, service, username, password):
            self.stored[(service, username)] = password

        def delete_password(self, service, username):
            self.stored.pop((service, username), None)

    monkeypatch.delenv(PASSWORD_ENV)
    previous = keyring.get_keyring()
    keyring.set_keyring(MemoryKeyring())
    try:
        assert unread_count(mail_settings) == imap_server.num_unseen
    finally:
        keyring.set_keyring(previous)


def test_no_password_anywhere_says_where_to_put_it(mail_settings, monkeypatch):
    monkeypatch.delenv(PASSWORD_ENV)
    answer = ask(mail_settings, "new mail?")
    assert answer.is_error and PASSWORD_ENV in answer.text and f"keyring set {KEYRING_SERVICE}" in answer.text


def test_closed_port_says_unreachable(mail_settings):
    with socket.socket() as sock:       # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    answer = ask(replace(mail_settings, imap_port=port), "any unread messages")
    assert answer.is_error and f"Cannot reach the IMAP server 127.0.0.1:{port}" in answer.text


def test_silent_server_times_out(mail_settings):
    with socket.socket() as listener:   # accepts TCP (backlog) but never speaks TLS
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        answer = ask(replace(mail_settings, imap_port=port, imap_timeout_s=0.5), "any new emails")
    assert answer.is_error and "did not answer within 0.5 s" in answer.text


def test_plain_imap_is_refused_for_a_remote_host(mail_settings):
    settings = replace(mail_settings, imap_host="imap.example.org", imap_tls=False, imap_port=143)
    answer = ask(settings, "any new mail?")
    assert answer.is_error and "only allowed for a server on this machine" in answer.text


def test_not_configured_says_which_settings(monkeypatch):
    answer = ask(ProviderSettings(), "any new mail?")
    assert answer.is_error and "providers.imap_host" in answer.text


def test_concurrent_checks_each_get_the_count(mail_settings, imap_server):
    counts: list[int] = []
    threads = [threading.Thread(target=lambda: counts.append(unread_count(mail_settings))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert counts == [imap_server.num_unseen] * 3
