"""DeskEye's own small files, read and written so that a wrong path or a crash cannot hurt: the settings, the
hooks, the router's data and model, the run state.

Reading: every one of these is a path a person typed, so it may name a folder, a FIFO (which would block the read
for ever), a device (/dev/zero never ends) or a file far too large; `read_regular_text` refuses each of those with a
message naming the file and the fix, before reading a byte where it can. Writing: `write_file_atomically` leaves
either the old content or the new one, never an empty or half-written file, whatever happens meanwhile.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from deskeye.errors import SettingsError

_FILE_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def read_regular_text(path: Path, *, max_bytes: int, what: str, error: type[Exception] = SettingsError) -> str:
    """The UTF-8 text of a regular file of at most `max_bytes`. A folder, FIFO, device or socket is refused from
    its stat before it is opened (nothing blocks, /dev/zero is not read), and the file is opened non-blocking and
    checked again, so one swapped in meanwhile is refused too. A missing file raises FileNotFoundError (the
    caller decides what that means); anything else raises `error` naming the file, what was wrong and the fix."""
    try:
        _check_regular(path, os.stat(path), max_bytes, what, error)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise error(f"{path}: cannot read the {what}: {exc.strerror or exc}.") from None
    try:
        _check_regular(path, os.fstat(fd), max_bytes, what, error)
        data = _read_at_most(fd, max_bytes + 1)
    except OSError as exc:
        raise error(f"{path}: cannot read the {what}: {exc.strerror or exc}.") from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise error(f"{path}: over {max_bytes} bytes, too large for a {what}; check that the path names the "
                    "right file.")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not valid UTF-8 at byte offset {exc.start} (0x{data[exc.start]:02x}); "
                    f"save the {what} as UTF-8.") from None


def _check_regular(path: Path, info: os.stat_result, max_bytes: int, what: str, error: type[Exception]) -> None:
    if not stat.S_ISREG(info.st_mode):
        kind = next((name for is_kind, name in _FILE_KINDS if is_kind(info.st_mode)), "not a regular file")
        raise error(f"{path}: is {kind}; the {what} must be a regular file: give the path of one.")
    if info.st_size > max_bytes:
        raise error(f"{path}: {info.st_size} bytes, too large for a {what} (at most {max_bytes}); check that "
                    "the path names the right file.")


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks, size = [], 0
    while size < limit:
        chunk = os.read(fd, min(1 << 16, limit - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def write_file_atomically(path: Path, data: bytes) -> None:
    """Replace `path` by `data` in one step: a temp file in the same folder (mode 0600), written, fsync'd, then
    os.replace'd over it. On any failure (a full disk, a size limit, an interrupt) the temp file is removed and
    raised past: `path` stays as it was, never empty or half written. The folder must exist."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_folder(path.parent)


def _fsync_folder(folder: Path) -> None:
    """Make the rename itself durable where the platform allows it (best effort: the data is already safe)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
