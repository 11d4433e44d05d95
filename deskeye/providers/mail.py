"""Unread mail: "any new mail?", "有新邮件吗" — `STATUS <mailbox> (UNSEEN)` on the configured IMAP account.

IMAP over TLS (IMAP4_SSL, certificate and host name verified; `providers.imap_ca_file` adds a CA for a
self-signed server). Plain IMAP only to a loopback address, for a local test server. The password
comes from the environment variable named by `providers.imap_password_env`, else the OS keyring
(service "deskeye-imap", user = imap_user); it is read per call, and never logged or put in an error.
"""

from __future__ import annotations

import imaplib
import ipaddress
import logging
import os
import re
import socket
import ssl

from deskeye.errors import ProviderError
from deskeye.providers.base import QueryContext, has_text, has_word
from deskeye.settings import ProviderSettings

log = logging.getLogger(__name__)

NAME = "mail"
KEYRING_SERVICE = "deskeye-imap"
_EN = ("mail", "mails", "email", "emails", "e-mail", "emial", "emials", "inbox", "mailbox", "unread")
_ZH = ("邮件", "邮箱", "收件箱", "未读", "新信")
_UNSEEN = re.compile(rb"\(.*\bUNSEEN\s+(\d+)", re.I)


def matches(query: str) -> bool:
    return has_word(query, _EN) or has_text(query, _ZH)


def answer(query: str, ctx: QueryContext) -> str | None:
    settings = ctx.settings
    count = unread_count(settings)
    box = settings.imap_mailbox
    if count == 0:
        return ctx.say(f"No unread mail in {box} ({settings.imap_user}).",
                       f"{box} 没有未读邮件({settings.imap_user})。")
    plural = "email" if count == 1 else "emails"
    return ctx.say(f"You have {count} unread {plural} in {box} ({settings.imap_user}).",
                   f"{box} 有 {count} 封未读邮件({settings.imap_user})。")


def unread_count(settings: ProviderSettings) -> int:
    """The number of unseen messages in settings.imap_mailbox. Raises ProviderError with a user-facing reason."""
    if not settings.imap_host or not settings.imap_user:
        raise ProviderError("No mail account is configured: set providers.imap_host and providers.imap_user "
                            "in settings.toml, and the password in the environment variable "
                            f"{settings.imap_password_env} or the keyring (service '{KEYRING_SERVICE}').")
    password = _password(settings)
    where = f"{settings.imap_host}:{settings.imap_port}"
    try:
        return _count_unseen(settings, password)
    except imaplib.IMAP4.error as exc:
        reason = _scrub(_text(exc), password)
        raise ProviderError(f"The IMAP server {where} refused: {reason}. If that was the login, check the "
                            f"password in ${settings.imap_password_env} or the keyring entry "
                            f"'{KEYRING_SERVICE}' for user {settings.imap_user}.") from None
    except ssl.SSLCertVerificationError as exc:
        raise ProviderError(f"The TLS certificate of {where} is not trusted ({exc.verify_message}). For a "
                            "self-signed server set providers.imap_ca_file to its CA certificate.") from None
    except ssl.SSLError as exc:
        raise ProviderError(f"TLS with {where} failed ({exc.reason or exc}); is {settings.imap_port} an "
                            "IMAPS (implicit TLS) port? 993 is the usual one.") from None
    except (socket.timeout, TimeoutError):
        raise ProviderError(f"The IMAP server {where} did not answer within {settings.imap_timeout_s:g} s.") from None
    except OSError as exc:
        raise ProviderError(f"Cannot reach the IMAP server {where} ({exc.strerror or exc}).") from None


def _count_unseen(settings: ProviderSettings, password: str) -> int:
    client = _connect(settings)
    try:
        client.login(settings.imap_user, password)
        status, data = client.status(_quote(settings.imap_mailbox), "(UNSEEN)")
        if status != "OK":
            raise imaplib.IMAP4.error(f"STATUS {settings.imap_mailbox} failed: {_text(data)}")
        match = _UNSEEN.search(b" ".join(d for d in data if isinstance(d, bytes)))
        if not match:
            raise imaplib.IMAP4.error(f"no UNSEEN count in the STATUS reply {_text(data)}")
        count = int(match.group(1))
        log.info("mail: %d unseen in %s for %s on %s", count, settings.imap_mailbox, settings.imap_user,
                 settings.imap_host)
        return count
    finally:
        try:
            client.logout()
        except (imaplib.IMAP4.error, OSError):
            pass


def _connect(settings: ProviderSettings) -> imaplib.IMAP4:
    timeout_s = settings.imap_timeout_s
    if settings.imap_tls:
        context = ssl.create_default_context(cafile=settings.imap_ca_file or None)
        return imaplib.IMAP4_SSL(settings.imap_host, settings.imap_port, ssl_context=context, timeout=timeout_s)
    if not _is_loopback(settings.imap_host):
        raise ProviderError(f"providers.imap_tls = false is only allowed for a server on this machine; "
                            f"{settings.imap_host} is not. Use TLS (port 993).")
    return imaplib.IMAP4(settings.imap_host, settings.imap_port, timeout=timeout_s)


def _password(settings: ProviderSettings) -> str:
    password = os.environ.get(settings.imap_password_env, "") if settings.imap_password_env else ""
    if password:
        return password
    try:
        import keyring
        password = keyring.get_password(KEYRING_SERVICE, settings.imap_user) or ""
    except Exception as exc:  # noqa: BLE001 - any keyring backend failure means "no password here"
        log.debug("keyring lookup failed: %s", type(exc).__name__)
        password = ""
    if not password:
        raise ProviderError(f"No IMAP password for {settings.imap_user}: set the environment variable "
                            f"{settings.imap_password_env}, or store it with "
                            f"`keyring set {KEYRING_SERVICE} {settings.imap_user}`.")
    return password


def _quote(mailbox: str) -> str:
    return '"' + mailbox.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _text(value) -> str:
    if isinstance(value, BaseException):
        value = value.args[0] if value.args else str(value)
    if isinstance(value, list):
        value = b" ".join(v for v in value if isinstance(v, bytes))
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return str(value).strip()


def _scrub(text: str, secret: str) -> str:
    return text.replace(secret, "***") if secret else text
