"""The window list of sway (and any compositor that speaks sway's i3 IPC), read from its IPC socket.

On Wayland no program sees another's windows, but sway tells them over the socket named in $SWAYSOCK (its children
inherit it): one GET_TREE request returns the layout tree as JSON, and its leaves are the windows, native (an
`app_id`) and Xwayland (an X11 `window` id and `window_properties` with WM_CLASS), each with its title (`name`),
owning process (`pid`), place in layout pixels (`rect`, with its decorations), `focused` and `visible` (on a shown
workspace, not in the scratchpad). Privacy (deskeye/see/privacy.py) reads them as it reads X11 windows.

The wire format (i3's, which sway keeps): "i3-ipc", the payload's length and the message type as two native-endian
32-bit integers, then the payload; the reply has the same header. The reply is untrusted: its size is bounded
before anything is read (MAX_REPLY_BYTES; a title can be megabytes), the whole exchange by IPC_TIMEOUT_S, and it is
parsed with `json` only. A reply that breaks any of that is a SwayIpcError: the caller cannot tell which windows are
on screen, and says so (privacy does not look then).
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any, Iterator

from deskeye.errors import DeskEyeError
from deskeye.see.geometry import Rect

SOCKET_VARIABLES = ("SWAYSOCK", "I3SOCK")   # sway sets both for its children; i3 itself is an X11 window manager
MAGIC = b"i3-ipc"
HEADER = struct.Struct("=6sII")               # magic, payload length, message type (native byte order, as i3's)
GET_TREE = 4
IPC_TIMEOUT_S = 2.0                          # the whole request: connect, send, read
MAX_REPLY_BYTES = 32 << 20                   # a tree of a few hundred windows is well under 1 MiB
MAX_DEPTH = 64                               # the tree's nesting followed (outputs, workspaces, splits)
MAX_WINDOWS = 4096                           # the windows read from one tree
WINDOW_TYPES = ("con", "floating_con")


class SwayIpcError(DeskEyeError):
    """The compositor's IPC socket did not give a window tree (gone, too slow, too large, not JSON)."""


@dataclass(frozen=True)
class SwayWindow:
    """One window as sway lists it."""
    con_id: int                      # sway's container id
    x11_id: int | None               # the X11 window id of an Xwayland window, else None
    title: str
    app: tuple[str, ...]             # (app_id,) of a native window; (instance, class) of an Xwayland one
    pid: int | None
    rect: Rect                       # layout pixels, with decorations (borders, title bar)
    focused: bool
    visible: bool
    is_floating: bool


def socket_path(environ=os.environ) -> str:
    """The IPC socket this session's compositor names ("" where none does)."""
    return next((environ[name] for name in SOCKET_VARIABLES if environ.get(name)), "")


def read_windows(path: str, timeout_s: float = IPC_TIMEOUT_S) -> list[SwayWindow]:
    """Every window in the compositor's tree, bottom to top (tiled ones, then floating ones in their stacking
    order); SwayIpcError when the tree cannot be read."""
    return list(windows_of(get_tree(path, timeout_s)))


def get_tree(path: str, timeout_s: float = IPC_TIMEOUT_S) -> dict[str, Any]:
    """The compositor's layout tree (GET_TREE), parsed; SwayIpcError naming what went wrong."""
    deadline = time.monotonic() + timeout_s
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(path)
            sock.sendall(HEADER.pack(MAGIC, 0, GET_TREE))
            magic, length, kind = HEADER.unpack(_read_exactly(sock, HEADER.size, deadline))
            if magic != MAGIC or kind != GET_TREE:
                raise SwayIpcError(f"{path} did not answer as sway's IPC does (header {magic!r}, type {kind})")
            if length > MAX_REPLY_BYTES:
                raise SwayIpcError(f"{path} sent a window tree of {length} bytes (at most {MAX_REPLY_BYTES} read)")
            payload = _read_exactly(sock, length, deadline)
    except OSError as exc:             # no such socket, refused, timed out
        raise SwayIpcError(f"cannot read the window tree from {path}: {exc}") from None
    try:
        tree = json.loads(payload)
    except (ValueError, RecursionError) as exc:
        raise SwayIpcError(f"{path} sent a window tree that is not JSON: {exc}") from None
    if not isinstance(tree, dict):
        raise SwayIpcError(f"{path} sent a window tree that is not a JSON object")
    return tree


def _read_exactly(sock: socket.socket, size: int, deadline: float) -> bytes:
    chunks, left = [], size
    while left:
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0:
            raise SwayIpcError(f"the compositor took more than {IPC_TIMEOUT_S:.0f} s to send its window tree")
        sock.settimeout(remaining_s)
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise SwayIpcError("the compositor closed its IPC socket mid-reply")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def windows_of(tree: dict[str, Any]) -> Iterator[SwayWindow]:
    """The windows (leaves that are views) of a parsed tree, bottom to top; malformed nodes are skipped."""
    count = 0
    stack: list[tuple[Any, int, bool]] = [(tree, 0, False)]
    while stack and count < MAX_WINDOWS:
        node, depth, floating = stack.pop()
        if not isinstance(node, dict) or depth > MAX_DEPTH:
            continue
        tiled, floats = _list(node.get("nodes")), _list(node.get("floating_nodes"))
        window = _window(node, floating) if not tiled and not floats else None
        if window is not None:
            count += 1
            yield window
        # Popped last-in first-out: push floating (on top) first, each list reversed, so the walk is in order.
        stack.extend((child, depth + 1, True) for child in reversed(floats))
        stack.extend((child, depth + 1, floating) for child in reversed(tiled))


def _window(node: dict[str, Any], floating: bool) -> SwayWindow | None:
    if node.get("type") not in WINDOW_TYPES:
        return None
    app_id, x11_id, pid = node.get("app_id"), _int(node.get("window")), _int(node.get("pid"))
    if not isinstance(app_id, str) and x11_id is None and pid is None:
        return None                    # an empty container, not a view
    props = node.get("window_properties") if isinstance(node.get("window_properties"), dict) else {}
    app = ((_text(app_id),) if isinstance(app_id, str) and app_id
           else tuple(_text(props.get(key)) for key in ("instance", "class") if isinstance(props.get(key), str)))
    rect = node.get("rect") if isinstance(node.get("rect"), dict) else {}
    values = [_int(rect.get(key)) for key in ("x", "y", "width", "height")]
    if None in values:
        return None
    x, y, width, height = values
    return SwayWindow(_int(node.get("id")) or 0, x11_id, _text(node.get("name")), app, pid,
                      Rect(x, y, width, height), node.get("focused") is True, node.get("visible", True) is not False,
                      floating or node.get("type") == "floating_con")


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text(value: Any) -> str:
    """A string field whole (privacy matches a title whole: a page can pad its title to push the browser's
    private-window words far back), "" for anything else."""
    return value if isinstance(value, str) else ""
