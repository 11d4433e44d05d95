"""Desktop notifications: "the deep answer is ready", "a hook fired". `Notifier.notify(title, body) -> bool`.

Linux/BSD: org.freedesktop.Notifications.Notify on the session D-Bus, spoken directly with jeepney
(no subprocess); if that fails, `notify-send` as an argv list. macOS: `osascript`, the texts passed as
script arguments (`on run argv`), never spliced into the script. Elsewhere (Windows): logged only.
Model text is untrusted: control characters are dropped, lengths capped, and where the server
renders body markup (`body-markup` capability) `& < >` are escaped. `notify` never raises; it
returns whether a notification was handed to the desktop.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import sys
import threading

log = logging.getLogger(__name__)

BACKENDS = ("auto", "dbus", "notify-send", "osascript", "log")
MAX_TITLE_CHARS = 120
MAX_BODY_CHARS = 1000
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_BUS_NAME = "org.freedesktop.Notifications"
_OBJECT_PATH = "/org/freedesktop/Notifications"
_OSASCRIPT = ("on run argv", "display notification (item 2 of argv) with title (item 1 of argv)", "end run")


def clean_text(text: str, max_chars: int) -> str:
    """No control characters (newlines kept), at most max_chars characters."""
    text = _CONTROL.sub(" ", str(text)).strip()
    return text if len(text) <= max_chars else text[: max_chars - 1] + "…"


def escape_markup(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


class Notifier:
    def __init__(self, app_name: str = "DeskEye", *, backend: str = "auto", timeout_s: float = 3.0,
                 expire_ms: int = -1):
        if backend not in BACKENDS:
            raise ValueError(f"notification backend must be one of {', '.join(BACKENDS)}; got {backend!r}.")
        self.app_name = app_name
        self.backend = backend
        self.timeout_s = timeout_s
        self.expire_ms = expire_ms          # -1 = the server's default
        self._lock = threading.Lock()       # one notification at a time (callers: UI thread, hook threads)

    def notify(self, title: str, body: str) -> bool:
        """Show a notification. True if the desktop accepted it; False (and a log line) otherwise."""
        title, body = clean_text(title, MAX_TITLE_CHARS), clean_text(body, MAX_BODY_CHARS)
        with self._lock:
            for backend in self._backends():
                try:
                    if _SENDERS[backend](self, title, body):
                        return True
                except Exception as exc:  # noqa: BLE001 - a notification must never break the caller
                    log.info("notification via %s failed: %s", backend, exc)
        log.warning("notification not shown (no desktop notification service): %s: %s", title, body)
        return False

    def _backends(self) -> list[str]:
        if self.backend != "auto":
            return [self.backend]
        if sys.platform == "darwin":
            return ["osascript"]
        if sys.platform.startswith(("linux", "freebsd", "openbsd", "netbsd")):
            return ["dbus", "notify-send"]
        return ["log"]

    # ------------------------------------------------------------ backends

    def _send_dbus(self, title: str, body: str) -> bool:
        from jeepney import DBusAddress, new_method_call
        from jeepney.io.blocking import open_dbus_connection
        from jeepney.wrappers import unwrap_msg
        address = DBusAddress(_OBJECT_PATH, bus_name=_BUS_NAME, interface=_BUS_NAME)
        with open_dbus_connection(bus="SESSION", auth_timeout=self.timeout_s) as connection:
            capabilities = unwrap_msg(connection.send_and_get_reply(
                new_method_call(address, "GetCapabilities"), timeout=self.timeout_s))[0]
            if "body-markup" in capabilities:
                body = escape_markup(body)
            call = new_method_call(address, "Notify", "susssasa{sv}i", (
                self.app_name, 0, "dialog-information", title, body, [], {"urgency": ("y", 1)}, self.expire_ms))
            notification_id = unwrap_msg(connection.send_and_get_reply(call, timeout=self.timeout_s))[0]
        log.debug("notification %d shown via D-Bus", notification_id)
        return True

    def _send_notify_send(self, title: str, body: str) -> bool:
        if not shutil.which("notify-send"):
            return False
        argv = ["notify-send", f"--app-name={self.app_name}", "--", title, body]
        return _run(argv, self.timeout_s)

    def _send_osascript(self, title: str, body: str) -> bool:
        argv = ["osascript"]
        for line in _OSASCRIPT:
            argv += ["-e", line]
        return _run(argv + [title, body], self.timeout_s)

    def _send_log(self, title: str, body: str) -> bool:
        return False   # notify() logs what could not be shown


def _run(argv: list[str], timeout_s: float) -> bool:
    """Run a notifier program (no shell); True if it exited 0 within timeout_s."""
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.info("%s failed: %s", argv[0], exc)
        return False
    if done.returncode != 0:
        log.info("%s exited %d: %s", argv[0], done.returncode, done.stderr.decode(errors="replace").strip()[:200])
    return done.returncode == 0


_SENDERS = {"dbus": Notifier._send_dbus, "notify-send": Notifier._send_notify_send,
            "osascript": Notifier._send_osascript, "log": Notifier._send_log}
