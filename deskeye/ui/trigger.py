"""`deskeye trigger describe|ask|pause|resume`: the running app's hotkey actions, reachable from a command.

Why: in a Wayland session pynput's global hotkeys never see a key pressed while a native Wayland window has focus,
but every desktop runs a command on a key of the user's choosing (GNOME and KDE keyboard settings). So the app
listens on a Unix socket in the user's runtime folder, `$XDG_RUNTIME_DIR/deskeye/trigger.sock` (a private 0700
folder in the system temp folder when XDG_RUNTIME_DIR is unset), and `deskeye trigger ACTION` connects to it.

Who may trigger: the socket is 0600 in a 0700 folder, and the listener also asks the kernel who connected
(SO_PEERCRED): a process of another user is refused with a reply saying so, whatever the file modes became.

The wire, one exchange per connection: the command sends `ACTION\\n`; the app answers one JSON line
`{"ok": true|false, "message": "..."}` and closes. Anything else (bytes that are not a short line of ASCII, a line
too long, an unknown action, silence past READ_TIMEOUT_S) gets `ok: false` saying what was wrong, and the listener
serves on. One thread serves one connection at a time: every exchange is bounded by READ_TIMEOUT_S.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import stat
import struct
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from deskeye.errors import DeskEyeError
from deskeye.language import N_, _
from deskeye.lifecycle import kill_on_exit_now
from deskeye.ui.menu import MenuActions

log = logging.getLogger(__name__)

ACTIONS = ("describe", "ask", "pause", "resume")
FOLDER_NAME = "deskeye"
SOCKET_NAME = "trigger.sock"
MAX_REQUEST_BYTES = 64           # the longest action is 8 bytes: anything past this is not a request
MAX_REPLY_BYTES = 4096
MAX_DRAIN_BYTES = 4 << 20        # what a client may still send after the reply before it is cut off
DRAIN_CHUNK_BYTES = 64 << 10
MAX_SOCKET_PATH_BYTES = 107      # sockaddr_un's sun_path, less the terminating NUL
MAX_PENDING = 8                  # connections the kernel queues while one is served
READ_TIMEOUT_S = 2.0             # for a whole request: a client that trickles or stays silent is answered and dropped
CLIENT_TIMEOUT_S = 5.0
PROBE_TIMEOUT_S = 1.0            # does an existing socket still have an app behind it?
JOIN_TIMEOUT_S = 5.0
PEER_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid

NOT_RUNNING = N_("DeskEye is not running; start it with `deskeye run`.")


class TriggerError(DeskEyeError):
    """The trigger socket cannot be made, reached or used; the message says why and what to do."""


@dataclass(frozen=True)
class Reply:
    """The app's answer to one `deskeye trigger` request."""
    is_ok: bool
    message: str

    def encode(self) -> bytes:
        return (json.dumps({"ok": self.is_ok, "message": self.message}, ensure_ascii=False) + "\n").encode()

    @classmethod
    def decode(cls, data: bytes) -> Reply:
        try:
            fields = json.loads(data.decode("utf-8"))
            return cls(fields["ok"] is True, str(fields["message"]))
        except (ValueError, KeyError, TypeError):
            return cls(False, _("DeskEye sent a reply that is not a trigger reply: {data}").format(
                data=repr(data[:80])))


def socket_path(environ: Mapping[str, str] = os.environ) -> Path:
    """Where the app listens and `deskeye trigger` connects; nothing is created here."""
    runtime = environ.get("XDG_RUNTIME_DIR")
    folder = Path(runtime) / FOLDER_NAME if runtime else Path(tempfile.gettempdir()) / f"{FOLDER_NAME}-{os.getuid()}"
    return folder / SOCKET_NAME


def make_private_folder(folder: Path) -> None:
    """Create `folder` with mode 0700, or check that an existing one is this user's and private: in a shared temp
    folder another user could have made it first, to hold a socket of their own."""
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(folder)
    except OSError as exc:
        raise TriggerError(_("Cannot make the folder for DeskEye's trigger socket ({error}). Set XDG_RUNTIME_DIR "
                             "to a folder of yours.").format(error=exc)) from None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
        raise TriggerError(_("{folder} is not a private folder of this user (it must be a folder of yours with "
                             "mode 0700): remove it, or set XDG_RUNTIME_DIR, and start DeskEye again.").format(
                                 folder=folder))


class TriggerListener:
    """Serves `deskeye trigger` for the running app on its own thread (`deskeye-trigger`); `stop()` ends it.

    Each action calls the same function as the tray entry (`MenuActions`): they only enqueue work or post to the
    overlay's thread, so they return at once."""

    def __init__(self, actions: MenuActions, path: Path | None = None):
        self.actions = actions
        self.path = path if path is not None else socket_path()
        self._sock: socket.socket | None = None
        self._inode: int | None = None               # the socket file this listener made (a later app may replace it)
        self._wake_r, self._wake_w = -1, -1
        self._thread: threading.Thread | None = None

    @staticmethod
    def is_supported() -> bool:
        """Linux only: the peer check asks for SO_PEERCRED (macOS and Windows name the peer otherwise)."""
        return hasattr(socket, "SO_PEERCRED")

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Listen at `path`, replacing a socket a crashed app left; TriggerError if another DeskEye answers there."""
        if len(os.fsencode(self.path)) > MAX_SOCKET_PATH_BYTES:
            raise TriggerError(_("The trigger socket's path {path} is too long for a Unix socket; set XDG_RUNTIME_DIR "
                                 "to a shorter folder.").format(path=self.path))
        make_private_folder(self.path.parent)
        self._remove_stale_socket()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(os.fsencode(self.path))
            os.chmod(self.path, 0o600)         # the folder is 0700: nobody else could connect before this
            self._inode = os.lstat(self.path).st_ino
            sock.listen(MAX_PENDING)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            raise TriggerError(_("Cannot listen for `deskeye trigger` at {path}: {error}").format(
                path=self.path, error=exc)) from None
        self._sock = sock
        self._wake_r, self._wake_w = os.pipe()
        kill_on_exit_now(self)
        self._thread = threading.Thread(target=self._serve, name="deskeye-trigger", daemon=True)
        self._thread.start()
        log.info("listening for `deskeye trigger` at %s", self.path)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout_s: float = JOIN_TIMEOUT_S) -> None:
        """End the thread (at most `timeout_s`: an exchange in progress ends within READ_TIMEOUT_S) and remove the
        socket file, unless another app has replaced it meanwhile."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        os.write(self._wake_w, b"\0")
        thread.join(timeout_s)
        self._sock.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        self.kill()

    def kill(self) -> None:
        """Remove the socket file (unless another app has replaced it) and its folder once empty: the app leaves
        nothing behind. Takes no lock, so `exit_now` (deskeye/lifecycle.py) calls it too, when a stop cannot finish."""
        try:
            if os.lstat(self.path).st_ino == self._inode:
                os.unlink(self.path)
            os.rmdir(self.path.parent)         # only when empty: another app's socket stays
        except OSError:
            pass

    def _remove_stale_socket(self) -> None:
        try:
            info = os.lstat(self.path)
        except FileNotFoundError:
            return
        if stat.S_ISSOCK(info.st_mode) and _has_listener(self.path):
            raise TriggerError(_("Another DeskEye is running and listens at {path}: `deskeye trigger` reaches that "
                                 "one. Quit it to use this one.").format(path=self.path))
        try:
            os.unlink(self.path)               # left by an app that crashed (the folder is private: it is ours)
        except OSError as exc:
            raise TriggerError(_("Cannot remove the old trigger socket {path}: {error}").format(
                path=self.path, error=exc)) from None
        log.info("replaced the trigger socket a previous DeskEye left at %s", self.path)

    # ------------------------------------------------------------------ serving

    def _serve(self) -> None:
        while True:
            ready, _w, _x = select.select([self._sock, self._wake_r], [], [])
            if self._wake_r in ready:
                return
            try:
                conn, _address = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                continue                       # the client gave up before we got to it
            except OSError as exc:
                log.warning("`deskeye trigger`: accept failed: %s", exc)
                continue
            with conn:
                self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        """One exchange; whatever the client sent or did, the listener carries on. What the client still sends after
        the reply is read and dropped until it closes: closing with unread bytes would reset the connection, and the
        client could lose the reply."""
        try:
            conn.sendall(self._reply_to(conn).encode())
            conn.shutdown(socket.SHUT_WR)
            _drain(conn)
        except OSError as exc:                 # the client left, or kept sending past the bounds
            log.debug("`deskeye trigger`: exchange ended early: %s", exc)

    def _reply_to(self, conn: socket.socket) -> Reply:
        pid, uid, _gid = PEER_CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEER_CRED.size))
        try:
            action, bad_request = _read_action(conn), None
        except TriggerError as exc:
            action, bad_request = None, exc
        if uid != os.getuid():                 # whatever it asked for
            log.warning("`deskeye trigger`: refused process %d of user %d (DeskEye runs as user %d)",
                        pid, uid, os.getuid())
            return Reply(False, _("Refused: this DeskEye belongs to another user."))
        if bad_request is not None:
            log.info("`deskeye trigger`: bad request from process %d: %s", pid, bad_request)
            return Reply(False, str(bad_request))
        try:
            return Reply(True, self._run(action))
        except Exception as exc:               # an action that fails must not end the listener
            log.exception("`deskeye trigger %s` failed", action)
            return Reply(False, _("`deskeye trigger {action}` failed: {error}").format(action=action, error=exc))

    def _run(self, action: str) -> str:
        """Do `action` as the tray entry does; the reply's message."""
        actions, is_paused = self.actions, self.actions.is_paused()
        if action == "describe":
            actions.describe_now()
            return (_("DeskEye is paused: nothing is described until `deskeye trigger resume`.") if is_paused
                    else _("Describing the screen."))
        if action == "ask":
            actions.ask()
            return _("The Ask box is open.")
        if (action == "pause") != is_paused:      # pause when watching, resume when paused
            actions.toggle_pause()
        return _("Paused.") if action == "pause" else _("Watching again.")


def _read_action(conn: socket.socket) -> str:
    """The action in one request line, read within READ_TIMEOUT_S in all; TriggerError saying what was wrong."""
    data, deadline = b"", time.monotonic() + READ_TIMEOUT_S
    try:
        while b"\n" not in data and len(data) <= MAX_REQUEST_BYTES:
            conn.settimeout(max(deadline - time.monotonic(), 0.001))
            chunk = conn.recv(MAX_REQUEST_BYTES + 1 - len(data))
            if not chunk:
                break
            data += chunk
    except TimeoutError:
        raise TriggerError(_("No request within {seconds} s.").format(seconds=f"{READ_TIMEOUT_S:g}")) from None
    line, newline, _rest = data.partition(b"\n")
    if not newline and len(data) > MAX_REQUEST_BYTES:
        raise TriggerError(_("The request is too long: send one action per line ({actions}).").format(
            actions=", ".join(ACTIONS)))
    try:
        action = line.decode("ascii").strip().lower()
    except UnicodeDecodeError:
        raise TriggerError(_("The request is not a line of text: send one of {actions}.").format(
            actions=", ".join(ACTIONS))) from None
    if action not in ACTIONS:
        raise TriggerError(_("Unknown request {request}: DeskEye knows {actions}.").format(
            request=repr(action), actions=", ".join(ACTIONS)))
    return action


def _drain(conn: socket.socket) -> None:
    """Read and drop what the client sends until it closes, within READ_TIMEOUT_S and MAX_DRAIN_BYTES."""
    num_read, deadline = 0, time.monotonic() + READ_TIMEOUT_S
    while num_read < MAX_DRAIN_BYTES:
        conn.settimeout(max(deadline - time.monotonic(), 0.001))
        chunk = conn.recv(DRAIN_CHUNK_BYTES)
        if not chunk:
            return
        num_read += len(chunk)


def _has_listener(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(PROBE_TIMEOUT_S)
        try:
            probe.connect(os.fsencode(path))
        except OSError:                        # refused: nobody listens any more
            return False
    return True


# ------------------------------------------------------------------ the command

def send(action: str, path: Path | None = None, timeout_s: float = CLIENT_TIMEOUT_S) -> Reply:
    """Ask the running app to do `action`; TriggerError when it cannot be reached or does not answer."""
    path = path if path is not None else socket_path()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(os.fsencode(path))
        except (FileNotFoundError, ConnectionRefusedError):
            raise TriggerError(_(NOT_RUNNING)) from None
        except PermissionError:
            raise TriggerError(_("Cannot reach DeskEye at {path}: permission denied. That DeskEye belongs to another "
                                 "user; run `deskeye trigger` as the user who started it.").format(path=path)) from None
        except OSError as exc:
            raise TriggerError(_("Cannot reach DeskEye at {path}: {error}").format(path=path, error=exc)) from None
        data = b""
        try:
            try:
                sock.sendall(f"{action}\n".encode("ascii"))
            except (BrokenPipeError, ConnectionResetError):
                pass                           # it answered before reading (a refusal): its reply is still there
            while len(data) < MAX_REPLY_BYTES and (chunk := sock.recv(MAX_REPLY_BYTES - len(data))):
                data += chunk
        except TimeoutError:
            raise TriggerError(_("DeskEye did not answer within {seconds} s.").format(
                seconds=f"{timeout_s:g}")) from None
        except OSError as exc:
            raise TriggerError(_("DeskEye closed the connection: {error}").format(error=exc)) from None
    return Reply.decode(data)


def cmd_trigger(args, settings) -> int:
    """`deskeye trigger ACTION`: prints the app's reply; exit code 1 when it could not do it."""
    reply = send(args.action)
    if not reply.is_ok:
        raise TriggerError(reply.message)
    print(reply.message)
    return 0
