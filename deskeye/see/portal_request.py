"""xdg-desktop-portal over the D-Bus session bus (Gio): how a portal call is made, waited for, and failed clearly.

A Wayland compositor shows its screen only to the portal's clients (deskeye/see/portal_screencast.py,
portal_screenshot.py). Most portal methods answer twice: the call returns a Request object's path at once, and the
result comes later in that Request's `Response` signal (after a consent dialog, possibly). `PortalBus.request` makes
the call and waits for the signal, always within a bound.

Each `PortalBus` is a private connection to the session bus with a GLib main context of its own: the signals it
waits for are delivered to that context only, so a wait never runs, nor is run by, the tray's GTK main loop. The
portal ends every session of a connection when the connection closes, so `close()` also ends what was left open.

The bus address is DBUS_SESSION_BUS_ADDRESS, else `$XDG_RUNTIME_DIR/bus` (where systemd puts it): never GLib's
autolaunch, which would start a bus of its own with no portal on it. PyGObject is imported only when a bus is
opened: nothing here costs anything on X11.
"""

from __future__ import annotations

import itertools
import logging
import os
import stat
import threading
import time
from typing import Any, Mapping

from deskeye.errors import CaptureError
from deskeye.language import N_, _

log = logging.getLogger(__name__)

PORTAL_NAME = "org.freedesktop.portal.Desktop"
SCREENCAST_INTERFACE = "org.freedesktop.portal.ScreenCast"
SCREENSHOT_INTERFACE = "org.freedesktop.portal.Screenshot"
PORTAL_PATH = "/org/freedesktop/portal/desktop"
REQUEST_INTERFACE = "org.freedesktop.portal.Request"
SESSION_INTERFACE = "org.freedesktop.portal.Session"
CALL_TIMEOUT_S = 25.0         # one D-Bus call: the first one may start (D-Bus-activate) the portal and its backend
RESPONSE_TIMEOUT_S = 30.0     # a Request's answer, where no dialog is expected
RESPONSE_OK, RESPONSE_CANCELLED = 0, 1
MAX_ERROR_CHARS = 300         # a D-Bus error's text quoted to the user, at most
WAKE_S = 0.1                  # a wait returns to Python this often (signals are handled there)

# What the user reads (translated where it is raised).
NO_PORTAL = N_("No screen-capture portal answered on the D-Bus session bus ({cause}). Install xdg-desktop-portal "
               "and your desktop's backend (xdg-desktop-portal-gnome, xdg-desktop-portal-kde or "
               "xdg-desktop-portal-wlr), and start DeskEye inside your desktop session.")
NO_SESSION_BUS = N_("no session bus: DBUS_SESSION_BUS_ADDRESS is not set and {path} is not a bus socket")
NO_PYGOBJECT = N_("DeskEye talks to the screen-capture portal through PyGObject, which is missing here ({cause}). "
                  "Install it: `pip install 'deskeye[tray]'` (it needs libgirepository1.0-dev and libcairo2-dev), "
                  "or run scripts/run.sh, which does.")
DECLINED = N_("The screen-capture request was declined ({method}), so DeskEye does not see the screen. Start "
              "DeskEye again and allow it in the dialog your desktop shows.")
PORTAL_FAILED = N_("The screen-capture portal failed ({method}, response {code}).")
PORTAL_OFFERS_NEITHER = N_("the portal offers neither ScreenCast nor Screenshot: {error}")
NO_RESPONSE = N_("The screen-capture portal did not answer {method} within {seconds:.0f} s.")


def portal_offers(environ: Mapping[str, str] = os.environ) -> tuple[bool, bool]:
    """(ScreenCast, Screenshot): which captures the session bus's portal offers (asked by their `version`
    properties: cheap, nothing is grabbed); CaptureError (NO_PORTAL) where it offers neither."""
    bus = PortalBus(environ)
    offered, error = [], ""
    try:
        for interface in (SCREENCAST_INTERFACE, SCREENSHOT_INTERFACE):
            try:
                bus.property(interface, "version")
                offered.append(True)
            except Exception as exc:        # GLib.Error: no portal on the bus, or not that interface
                offered.append(False)
                error = error_text(exc)
    finally:
        bus.close()
    if not any(offered):
        cause = error if "ServiceUnknown" in error else _(PORTAL_OFFERS_NEITHER).format(error=error)
        raise CaptureError(_(NO_PORTAL).format(cause=cause))
    return offered[0], offered[1]


def session_bus_address(environ: Mapping[str, str] = os.environ) -> str:
    """The session bus's address, or CaptureError (no portal can answer without a bus)."""
    address = environ.get("DBUS_SESSION_BUS_ADDRESS", "").strip()
    if address:
        return address
    path = os.path.join(environ.get("XDG_RUNTIME_DIR", "") or f"/run/user/{os.getuid()}", "bus")
    try:
        if stat.S_ISSOCK(os.stat(path).st_mode):
            from gi.repository import Gio
            return f"unix:path={Gio.dbus_address_escape_value(path)}"
    except OSError:
        pass
    raise CaptureError(_(NO_PORTAL).format(cause=_(NO_SESSION_BUS).format(path=path)))


def import_gio():
    """(Gio, GLib) from PyGObject, or CaptureError saying how to install it."""
    try:
        from gi.repository import Gio, GLib
    except ImportError as exc:
        raise CaptureError(_(NO_PYGOBJECT).format(cause=exc)) from None
    return Gio, GLib


def iterate_once(glib, context, timeout_s: float) -> None:
    """Run `context` for one iteration, waiting at most `timeout_s` (a timer wakes it: Python runs in between, so a
    SIGTERM or a stop flag is seen at once)."""
    timer = glib.timeout_source_new(max(1, int(timeout_s * 1000)))
    timer.set_callback(lambda *_args: False)
    timer.attach(context)
    try:
        context.iteration(True)
    finally:
        timer.destroy()


def error_text(exc: BaseException) -> str:
    """A D-Bus or GStreamer error's message, bounded (it is quoted to the user)."""
    text = getattr(exc, "message", None) or str(exc)
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + "..."


class PortalBus:
    """A private session-bus connection to xdg-desktop-portal. Thread-safe for calls; one `request` waits at a time."""

    _tokens = itertools.count(1)

    def __init__(self, environ: Mapping[str, str] = os.environ, *, timeout_s: float = CALL_TIMEOUT_S):
        Gio, GLib = import_gio()
        self._gio, self._glib = Gio, GLib
        self.timeout_s = timeout_s
        self._context = GLib.MainContext.new()
        self._wait_lock = threading.Lock()
        flags = Gio.DBusConnectionFlags.AUTHENTICATION_CLIENT | Gio.DBusConnectionFlags.MESSAGE_BUS_CONNECTION
        try:
            self.conn = Gio.DBusConnection.new_for_address_sync(session_bus_address(environ), flags, None, None)
        except GLib.Error as exc:
            raise CaptureError(_(NO_PORTAL).format(cause=error_text(exc))) from None
        self._sender = self.conn.get_unique_name().lstrip(":").replace(".", "_")

    def variant(self, signature: str, value: Any):
        return self._glib.Variant(signature, value)

    def call(self, interface: str, method: str, signature: str | None, args: tuple | None, *,
             path: str = PORTAL_PATH, reply: str | None = None, timeout_s: float | None = None):
        """A plain method call -> its unpacked reply; GLib.Error is raised past (the caller names what failed)."""
        params = self._glib.Variant(signature, args) if signature is not None else None
        result = self.conn.call_sync(PORTAL_NAME, path, interface, method, params,
                                     self._glib.VariantType(reply) if reply else None,
                                     self._gio.DBusCallFlags.NONE, int((timeout_s or self.timeout_s) * 1000), None)
        return result.unpack() if result is not None else None

    def call_with_fd(self, interface: str, method: str, signature: str, args: tuple) -> int:
        """A method that answers one file descriptor (`h`): a duplicate the caller owns and must close."""
        result, fds = self.conn.call_with_unix_fd_list_sync(
            PORTAL_NAME, PORTAL_PATH, interface, method, self._glib.Variant(signature, args),
            self._glib.VariantType("(h)"), self._gio.DBusCallFlags.NONE, int(self.timeout_s * 1000), None, None)
        return fds.get(result.unpack()[0])      # Gio.UnixFDList.get dup()s it

    def property(self, interface: str, name: str):
        """A portal property's value; GLib.Error where the portal, or that interface, is not there."""
        return self.call("org.freedesktop.DBus.Properties", "Get", "(ss)", (interface, name), reply="(v)")[0]

    def token(self) -> str:
        return f"deskeye{os.getpid()}_{next(self._tokens)}"

    def request(self, interface: str, method: str, signature: str, args: tuple, *,
                timeout_s: float = RESPONSE_TIMEOUT_S) -> dict:
        """Call `method`, whose last argument is its options (a{sv}), and wait for its Request's Response -> the
        results (unpacked). CaptureError when the portal declines, fails or does not answer in `timeout_s`."""
        token = self.token()
        options = dict(args[-1]) | {"handle_token": self._glib.Variant("s", token)}
        expected = f"{PORTAL_PATH}/request/{self._sender}/{token}"
        answer: dict = {}

        def on_response(_conn, _sender, _path, _iface, _signal, params, *_data):
            answer["code"], answer["results"] = params.unpack()

        with self._wait_lock:
            self._context.push_thread_default()     # the signal is delivered to the context current at subscription
            try:
                subscription = self.conn.signal_subscribe(PORTAL_NAME, REQUEST_INTERFACE, "Response", expected,
                                                          None, self._gio.DBusSignalFlags.NONE, on_response)
            finally:
                self._context.pop_thread_default()
            try:
                handle = self.call(interface, method, signature, (*args[:-1], options), reply="(o)")[0]
                if handle != expected:             # a portal older than 0.9 names its own Request path
                    log.debug("the portal's request path is %s, not %s", handle, expected)
                self._wait(answer, timeout_s)
            except self._glib.Error as exc:
                raise CaptureError(f"{_(PORTAL_FAILED).format(method=method, code='-')} {error_text(exc)}") from None
            finally:
                self.conn.signal_unsubscribe(subscription)
        if "code" not in answer:
            raise CaptureError(_(NO_RESPONSE).format(method=method, seconds=timeout_s))
        if answer["code"] == RESPONSE_CANCELLED:
            raise PortalDeclined(_(DECLINED).format(method=method))
        if answer["code"] != RESPONSE_OK:
            raise CaptureError(_(PORTAL_FAILED).format(method=method, code=answer["code"]))
        return answer["results"]

    def _wait(self, answer: dict, timeout_s: float) -> None:
        """Run this bus's own main context until the Response came, or `timeout_s` passed. It wakes every WAKE_S so
        that Python runs in between: a SIGTERM or Ctrl+C stops a wait for the user's answer to a dialog at once."""
        deadline = time.monotonic() + timeout_s
        while "code" not in answer:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            iterate_once(self._glib, self._context, min(left, WAKE_S))

    def session_path(self, token: str) -> str:
        """The object path of the session this connection creates with `session_handle_token` = `token`."""
        return f"{PORTAL_PATH}/session/{self._sender}/{token}"

    def on_signal(self, interface: str, name: str, callback, *, path: str | None = None) -> None:
        """Call `callback(parameters unpacked)` for each `name` signal of the portal's `interface` (from `path`
        only, if given): delivered by `serve`, `pump` and during a `request`, on the thread that runs them."""
        self._context.push_thread_default()   # the signal is delivered to the context current at subscription
        try:
            self.conn.signal_subscribe(PORTAL_NAME, interface, name, path, None, self._gio.DBusSignalFlags.NONE,
                                       lambda _c, _s, _p, _i, _n, params, *_d: callback(params.unpack()))
        finally:
            self._context.pop_thread_default()

    def on_session_closed(self, session_handle: str, callback) -> None:
        """Call `callback()` when the portal ends the session (the user stopped the sharing in the desktop's
        indicator): delivered by `pump()` (and during a `request`), on the caller's thread."""
        self.on_signal(SESSION_INTERFACE, "Closed", lambda _params: callback(), path=session_handle)

    def serve(self, stop: threading.Event) -> None:
        """Deliver this connection's signals as they come until `stop` is set (checked every WAKE_S)."""
        while not stop.is_set():
            with self._wait_lock:
                iterate_once(self._glib, self._context, WAKE_S)

    def pump(self) -> None:
        """Deliver the signals that came meanwhile, without waiting (another thread's wait delivers them too)."""
        with self._wait_lock:
            while self._context.pending():
                self._context.iteration(False)

    def close_session(self, session_handle: str) -> None:
        """End a portal session (ScreenCast): best effort, the connection's close ends it anyway."""
        try:
            self.call(SESSION_INTERFACE, "Close", None, None, path=session_handle, timeout_s=5.0)
        except self._glib.Error as exc:
            log.debug("closing the portal session %s: %s", session_handle, error_text(exc))

    def close(self) -> None:
        try:
            self.conn.close_sync(None)
        except self._glib.Error as exc:
            log.debug("closing the session bus connection: %s", error_text(exc))


class PortalDeclined(CaptureError):
    """The user said no in the portal's dialog: DeskEye must not look another way (no fallback)."""
