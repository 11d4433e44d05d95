"""Unread mail: "any new mail?", "有新邮件吗" — `STATUS <mailbox> (UNSEEN)` on the configured IMAP account.

IMAP over TLS (IMAP4_SSL, certificate and host name verified; `providers.imap_ca_file` adds a CA for a
self-signed server). Plain IMAP only to a loopback address, for a local test server. The password
comes from the environment variable named by `providers.imap_password_env`, else the OS keyring
(service "deskeye-imap", user = imap_user); it is read per call, and never logged or put in an error.

A server cannot hold the check up or exhaust memory: `providers.imap_timeout_s` is one deadline for the
whole check (connect, TLS, greeting, login, STATUS, logout), measured from a monotonic start and given
to every socket operation as what is left of it, so a server trickling a byte at a time still runs out;
a line may be at most MAX_LINE_BYTES, a literal at most MAX_LITERAL_BYTES and all that the server sends
at most MAX_REPLY_BYTES; the STATUS reply is read by hand in one pass (no regex on server text).
"""

from __future__ import annotations

import imaplib
import ipaddress
import logging
import os
import socket
import ssl
import time

from deskeye.errors import ProviderError
from deskeye.ask.providers.base import QueryContext, has_text, has_word
from deskeye.settings import ProviderSettings

log = logging.getLogger(__name__)

NAME = "mail"
LABEL, LABEL_ZH = "The mail server", "邮件服务器"     # who "did not answer" when it is too slow
KEYRING_SERVICE = "deskeye-imap"
_EN = ("mail", "mails", "email", "emails", "e-mail", "emial", "emials", "inbox", "mailbox", "unread")
_ZH = ("邮件", "邮箱", "收件箱", "未读", "新信")
MAX_LINE_BYTES = 1_000_000      # imaplib's own limit for one line
MAX_LITERAL_BYTES = 64 * 1024   # a STATUS check never needs a larger {literal}
MAX_REPLY_BYTES = 4_000_000     # everything the server may send during one check
_RECV_BYTES = 64 * 1024
_ANSWER_GRACE_S = 1.0           # the quick-answer caller waits this much longer than the IMAP deadline
_MAX_QUOTED_CHARS = 120         # of server text quoted in an error


def timeout_s(settings: ProviderSettings) -> float:
    """How long the quick-answer caller waits: the check's own deadline, so its own error comes first."""
    return settings.imap_timeout_s + _ANSWER_GRACE_S


class ImapReplyError(Exception):
    """The server sent more than a STATUS check accepts (an oversized line, literal or reply)."""


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
    deadline = time.monotonic() + settings.imap_timeout_s
    try:
        return _count_unseen(settings, password, deadline)
    except ImapReplyError as exc:
        raise ProviderError(f"The IMAP server {where} sent a reply DeskEye does not accept: "
                            f"{_scrub(str(exc), password)}. Is {where} an IMAP server?") from None
    except imaplib.IMAP4.error as exc:
        if time.monotonic() >= deadline:     # imaplib reports a send that ran out of time as IMAP4.abort
            raise _timed_out(settings, where) from None
        reason = _quoted(_scrub(_text(exc), password))
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
        raise _timed_out(settings, where) from None
    except OSError as exc:
        raise ProviderError(f"Cannot reach the IMAP server {where} ({exc.strerror or exc}).") from None


def _timed_out(settings: ProviderSettings, where: str) -> ProviderError:
    return ProviderError(f"The IMAP server {where} did not answer within {settings.imap_timeout_s:g} s.")


def _count_unseen(settings: ProviderSettings, password: str, deadline: float) -> int:
    client = _connect(settings, deadline)
    try:
        client.login(settings.imap_user, password)
        status, data = client.status(_quote(settings.imap_mailbox), "(UNSEEN)")
        if status != "OK":
            raise imaplib.IMAP4.error(f"STATUS {settings.imap_mailbox} failed: {_quoted(_text(data))}")
        count = unseen_in_status(b" ".join(d for d in data if isinstance(d, bytes)))
        if count is None:
            raise imaplib.IMAP4.error(f"no UNSEEN count in the STATUS reply {_quoted(_text(data))}")
        log.info("mail: %d unseen in %s for %s on %s", count, settings.imap_mailbox, settings.imap_user,
                 settings.imap_host)
        return count
    finally:
        try:
            client.logout()
        except (imaplib.IMAP4.error, ImapReplyError, OSError):
            client.shutdown_quietly()


def unseen_in_status(reply: bytes) -> int | None:
    """The UNSEEN count in a STATUS reply such as `"INBOX" (MESSAGES 5 UNSEEN 3)`, in one linear pass.

    The attribute list is the reply's last parenthesised group (a mailbox name may hold parentheses)."""
    opening = reply.rfind(b"(")
    closing = reply.find(b")", opening + 1)
    if opening < 0 or closing < 0:
        return None
    words = reply[opening + 1:closing].split()
    for name, value in zip(words[::2], words[1::2]):
        if name.upper() == b"UNSEEN" and value.isdigit() and len(value) <= 12:
            return int(value)
    return None


def _connect(settings: ProviderSettings, deadline: float) -> imaplib.IMAP4:
    if settings.imap_tls:
        context = ssl.create_default_context(cafile=settings.imap_ca_file or None)
        return _BoundedImapSSL(settings.imap_host, settings.imap_port, ssl_context=context, deadline=deadline)
    if not _is_loopback(settings.imap_host):
        raise ProviderError(f"providers.imap_tls = false is only allowed for a server on this machine; "
                            f"{settings.imap_host} is not. Use TLS (port 993).")
    return _BoundedImap(settings.imap_host, settings.imap_port, deadline=deadline)


class _BoundedIO:
    """imaplib's socket I/O under one deadline for the whole check, with what the server sends bounded.

    imaplib reads through a buffered file whose timeout is per read, so a server sending a byte now and
    then never times out; here every socket call gets only what is left of the deadline."""

    def __init__(self, *args, deadline: float, **kwargs):
        self._deadline = deadline
        self._pending = bytearray()      # received, not yet handed to imaplib
        self._num_received = 0
        super().__init__(*args, **kwargs)

    def _time_left(self) -> float:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the IMAP check ran out of time")
        return left

    def _create_socket(self, timeout):
        return super()._create_socket(self._time_left())

    def _receive(self) -> bool:
        """Append what the server sends next to the buffer; False at the end of the stream."""
        self.sock.settimeout(self._time_left())
        chunk = self.sock.recv(_RECV_BYTES)
        self._num_received += len(chunk)
        if self._num_received > MAX_REPLY_BYTES:
            raise ImapReplyError(f"more than {MAX_REPLY_BYTES:,} bytes in one check")
        self._pending += chunk
        return bool(chunk)

    def readline(self) -> bytes:
        scanned = 0
        while (end := self._pending.find(b"\n", scanned)) < 0:
            scanned = len(self._pending)
            if scanned > MAX_LINE_BYTES:
                raise ImapReplyError(f"a line longer than {MAX_LINE_BYTES:,} bytes")
            if not self._receive():
                end = len(self._pending) - 1     # the end of the stream: imaplib reports the cut line
                break
        line = bytes(self._pending[:end + 1])
        del self._pending[:end + 1]
        return line

    def read(self, size: int) -> bytes:
        if size > MAX_LITERAL_BYTES:
            raise ImapReplyError(f"a literal of {size:,} bytes (at most {MAX_LITERAL_BYTES:,} are read)")
        while len(self._pending) < size and self._receive():
            pass
        data = bytes(self._pending[:size])
        del self._pending[:size]
        return data

    def send(self, data: bytes) -> None:
        self.sock.settimeout(self._time_left())
        self.sock.sendall(data)           # one deadline for the whole call since Python 3.5

    def shutdown_quietly(self) -> None:
        try:
            self.shutdown()
        except OSError:
            pass


class _BoundedImap(_BoundedIO, imaplib.IMAP4):
    pass


class _BoundedImapSSL(_BoundedIO, imaplib.IMAP4_SSL):
    def _create_socket(self, timeout):
        sock = imaplib.IMAP4._create_socket(self, self._time_left())
        sock.settimeout(self._time_left())    # the TLS handshake: one deadline for the whole call
        return self.ssl_context.wrap_socket(sock, server_hostname=self.host)


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


def _quoted(text: str) -> str:
    return text if len(text) <= _MAX_QUOTED_CHARS else text[:_MAX_QUOTED_CHARS - 1] + "…"


def _scrub(text: str, secret: str) -> str:
    return text.replace(secret, "***") if secret else text
