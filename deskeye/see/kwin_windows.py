"""The window list of KWin (KDE Plasma on Wayland), read with a KWin script.

On Wayland no program sees another's windows, and KWin has no D-Bus call that lists them; but it runs scripts it is
given over D-Bus (`org.kde.KWin /Scripting loadScript`), and a script sees every window, native and Xwayland, with
its title (`caption`), app (`resourceClass`, `resourceName`, `desktopFileName`), process (`pid`), place
(`frameGeometry`, in the desktop's pixels), whether it is minimized and on the current virtual desktop, and which one
is active. So each `read()` loads a short script that sends that list back to DeskEye's own D-Bus object as one JSON
string (`callDBus`), runs it, and unloads it: ~15 ms on headless kwin_wayland 5.27.

What comes back is untrusted: it is taken only from KWin's own bus connection (the sender is checked), bounded
(MAX_REPLY_CHARS) and parsed with `json` only, field by field. A KWin that does not answer within READ_TIMEOUT_S, or
answers something else, is a KWinError: the caller cannot tell which windows are on screen, and says so (privacy
does not look then), as with sway's IPC (deskeye/see/sway_windows.py).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from deskeye.errors import DeskEyeError
from deskeye.see.geometry import Rect

log = logging.getLogger(__name__)

KWIN_NAME = "org.kde.KWin"
SCRIPTING_PATH = "/Scripting"
SCRIPTING_INTERFACE = "org.kde.kwin.Scripting"
REPORT_PATH = "/org/deskeye/KWinWindows"
REPORT_INTERFACE = "org.deskeye.KWinWindows"
READ_TIMEOUT_S = 2.0
CALL_TIMEOUT_MS = 2000
MAX_REPLY_CHARS = 8 << 20            # a few hundred windows are well under 1 MiB
MAX_WINDOWS = 4096
NATIVE_ID_BASE = 1 << 40             # ids given to native windows (from KWin's internal id): never an X11 id
WAKE_S = 0.05

REPORT_XML = f"""<node><interface name="{REPORT_INTERFACE}"><method name="Report">
<arg type="s" name="windows" direction="in"/></method></interface></node>"""

# The script: every window KWin manages, bottom to top, then the list to DeskEye. KWin 6 names the calls windowList
# and activeWindow; 5.27, clientList and activeClient. Strings are JSON-quoted into it: nothing else is inserted.
SCRIPT = """
var list = workspace.windowList ? workspace.windowList() : workspace.clientList();
var active = workspace.activeWindow || workspace.activeClient;
var current = workspace.currentDesktop;
var out = [];
for (var i = 0; i < list.length; i++) {
    var w = list[i];
    var g = w.frameGeometry;
    var here = w.onAllDesktops || (w.desktops ? w.desktops.indexOf(current) >= 0 : w.desktop === current);
    out.push({id: String(w.internalId), x11: w.windowId || 0, caption: String(w.caption),
              app: [String(w.resourceName || ""), String(w.resourceClass || ""), String(w.desktopFileName || "")],
              pid: w.pid || 0, x: g.x, y: g.y, width: g.width, height: g.height, active: w === active,
              visible: !w.minimized && here && !w.deleted});
}
callDBus(%(service)s, %(path)s, %(interface)s, "Report", JSON.stringify(out));
"""


class KWinError(DeskEyeError):
    """KWin did not give a window list (not running, no scripting, too slow, a malformed answer)."""


@dataclass(frozen=True)
class KWinWindow:
    window_id: int                   # the X11 id of an Xwayland window, else one derived from KWin's internal id
    x11_id: int | None
    title: str
    app: tuple[str, ...]             # (resourceName, resourceClass, desktopFileName), the empty ones left out
    pid: int | None
    rect: Rect                       # the desktop's pixels, with decorations
    focused: bool
    visible: bool                    # not minimized, on the current virtual desktop
    internal_id: str = ""            # KWin's own id ("{uuid}"), what its portal keeps for a shared window


def kwin_runs(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this session is KDE Plasma's (XDG_CURRENT_DESKTOP names KDE): KWin then lists its windows."""
    return "KDE" in environ.get("XDG_CURRENT_DESKTOP", "").upper().split(":")


class KWinWindows:
    """Reads KWin's window list; one read at a time (a lock), any thread. `close()` ends the bus connection."""

    def __init__(self, environ: Mapping[str, str] = os.environ):
        self._environ = dict(environ)
        self._lock = threading.Lock()
        self._conn = None
        self._context = None
        self._reply: dict[str, Any] = {}
        self._folder: tempfile.TemporaryDirectory | None = None
        self._reads = 0

    def read(self) -> list[KWinWindow]:
        """Every window KWin manages, bottom to top; KWinError when it cannot tell."""
        with self._lock:
            try:
                self._connect()
                return parse_windows(self._run_script())
            except KWinError:
                raise
            except Exception as exc:  # noqa: BLE001 - GLib.Error: KWin is not there, or refused the script
                raise KWinError(f"KWin did not list its windows: {_message(exc)}") from None

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                try:
                    self._conn.close_sync(None)
                except Exception as exc:  # noqa: BLE001 - closing anyway
                    log.debug("closing the KWin connection: %s", exc)
                self._conn = None
            if self._folder is not None:
                self._folder.cleanup()
                self._folder = None

    def _connect(self) -> None:
        if self._conn is not None:
            return
        from deskeye.see.portal_request import import_gio, session_bus_address
        Gio, GLib = import_gio()
        self._gio, self._glib = Gio, GLib
        flags = Gio.DBusConnectionFlags.AUTHENTICATION_CLIENT | Gio.DBusConnectionFlags.MESSAGE_BUS_CONNECTION
        conn = Gio.DBusConnection.new_for_address_sync(session_bus_address(self._environ), flags, None, None)
        self._context = GLib.MainContext.new()
        self._context.push_thread_default()      # method calls on the object are dispatched to this context
        try:
            interface = Gio.DBusNodeInfo.new_for_xml(REPORT_XML).interfaces[0]
            conn.register_object(REPORT_PATH, interface, self._on_call, None, None)
        finally:
            self._context.pop_thread_default()
        self._folder = tempfile.TemporaryDirectory(prefix="deskeye-kwin-")     # 0700: KWin reads the script there
        self._script = Path(self._folder.name) / "windows.js"
        self._script.write_text(SCRIPT % {"service": json.dumps(conn.get_unique_name()),
                                          "path": json.dumps(REPORT_PATH),
                                          "interface": json.dumps(REPORT_INTERFACE)}, encoding="utf-8")
        self._conn = conn

    def _on_call(self, _conn, sender, _path, _interface, method, params, invocation) -> None:
        if method == "Report" and sender == self._reply.get("kwin") and "windows" not in self._reply:
            self._reply["windows"] = params.unpack()[0]
        invocation.return_value(None)

    def _call(self, path: str, interface: str, method: str, signature: str | None = None, args: tuple | None = None):
        params = self._glib.Variant(signature, args) if signature else None
        reply = self._conn.call_sync(KWIN_NAME, path, interface, method, params, None, self._gio.DBusCallFlags.NONE,
                                     CALL_TIMEOUT_MS, None)
        return reply.unpack() if reply is not None else None

    def _run_script(self) -> str:
        from deskeye.see.portal_request import iterate_once
        owner = self._conn.call_sync("org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus",
                                     "GetNameOwner", self._glib.Variant("(s)", (KWIN_NAME,)), None,
                                     self._gio.DBusCallFlags.NONE, CALL_TIMEOUT_MS, None).unpack()[0]
        self._reply = {"kwin": owner}
        self._reads += 1
        plugin = f"deskeye-windows-{os.getpid()}-{self._reads}"
        self._call(SCRIPTING_PATH, SCRIPTING_INTERFACE, "loadScript", "(ss)", (str(self._script), plugin))
        try:
            self._call(SCRIPTING_PATH, SCRIPTING_INTERFACE, "start")
            deadline = time.monotonic() + READ_TIMEOUT_S
            while "windows" not in self._reply and time.monotonic() < deadline:
                iterate_once(self._glib, self._context, WAKE_S)
        finally:
            self._call(SCRIPTING_PATH, SCRIPTING_INTERFACE, "unloadScript", "(s)", (plugin,))
        if "windows" not in self._reply:
            raise KWinError(f"KWin did not list its windows within {READ_TIMEOUT_S:.0f} s")
        return self._reply["windows"]


def parse_windows(text: Any) -> list[KWinWindow]:
    """The windows in a script's answer; KWinError where it is not a bounded JSON list. Malformed entries are
    skipped (a window KWin could not describe is not one DeskEye can judge either: it has no title)."""
    if not isinstance(text, str) or len(text) > MAX_REPLY_CHARS:
        raise KWinError(f"KWin's window list is not a string of at most {MAX_REPLY_CHARS} characters")
    try:
        entries = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise KWinError(f"KWin's window list is not JSON: {exc}") from None
    if not isinstance(entries, list):
        raise KWinError("KWin's window list is not a JSON list")
    windows = []
    for entry in entries[:MAX_WINDOWS]:
        window = _window(entry) if isinstance(entry, dict) else None
        if window is not None:
            windows.append(window)
    return windows


def _window(entry: dict[str, Any]) -> KWinWindow | None:
    numbers = [entry.get(key) for key in ("x", "y", "width", "height")]
    if not all(isinstance(n, (int, float)) and not isinstance(n, bool) for n in numbers):
        return None
    x, y, width, height = (round(n) for n in numbers)
    x11 = entry.get("x11")
    x11_id = x11 if isinstance(x11, int) and not isinstance(x11, bool) and x11 > 0 else None
    internal = entry.get("id") if isinstance(entry.get("id"), str) else ""
    app = entry.get("app") if isinstance(entry.get("app"), list) else []
    pid = entry.get("pid")
    return KWinWindow(x11_id or NATIVE_ID_BASE + zlib.crc32(internal.encode("utf-8", "replace")), x11_id,
                      _text(entry.get("caption")), tuple(a for a in app if isinstance(a, str) and a),
                      pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else None,
                      Rect(x, y, width, height), entry.get("active") is True, entry.get("visible") is not False,
                      internal[:64])


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _message(exc: BaseException) -> str:
    text = getattr(exc, "message", None) or str(exc)
    return text if len(text) <= 300 else text[:300] + "..."
