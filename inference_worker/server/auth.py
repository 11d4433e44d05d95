"""The worker's bearer key and the state file that tells the app (only the same user) where to find it.

The key is given (--api-key) or generated per launch. The state file holds
`{"url", "api_key", "pid", "model", "engine", "limits"}`, where `limits` are the request limits the worker
enforces, as integers: `max_image_pixels`, `max_request_pixels`, `max_images`, `max_tokens_limit`,
`max_prompt_tokens` (the loaded model's effective limit; the flag's value, 0 = the model's context, until the
model is loaded) and `max_body_bytes` (lifetime.published_limits). It is written when the worker listens and again
once the engine is ready, created with mode 0600 in a 0700 folder, replaced atomically (a reader never sees half a
file; a failed write leaves no temporary file) and removed on clean exit.
A folder other users can write is refused: they could replace the file and point the app at their server.
A file left by a killed worker does not block a new one, even when its pid now belongs to another process:
the owner counts as alive only if a process with that pid exists and started before the file was written.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import stat
from pathlib import Path

STATE_FILE_NAME = "worker.json"
#: create times come from boot time + clock ticks: allow this much error when comparing with the file's mtime
CREATE_TIME_SLACK_S = 1.0


class StateFileError(RuntimeError):
    """The state file cannot be written, or another live worker owns it."""


def new_api_key() -> str:
    return secrets.token_urlsafe(32)


def is_authorized(header: str | None, api_key: str) -> bool:
    """True when `header` is `Bearer <api_key>`; compared in constant time."""
    if not header:
        return False
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode("utf-8"), api_key.encode("utf-8"))


def default_state_file() -> Path:
    import platformdirs
    import warnings
    with warnings.catch_warnings():   # "XDG_RUNTIME_DIR is not set": platformdirs then uses /tmp/runtime-<uid>
        warnings.simplefilter("ignore")
        return Path(platformdirs.user_runtime_dir("deskeye", appauthor=False)) / STATE_FILE_NAME


def write_state_file(path: Path, state: dict) -> None:
    """Write `state` as JSON readable only by this user. Refuses to replace a live worker's file and refuses a
    folder other users can write."""
    _refuse_shared_folder(path.parent)
    _refuse_live_owner(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(state, out)
        os.replace(tmp, path)
    except (OSError, TypeError, ValueError) as exc:
        _discard(tmp)
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise StateFileError(f"cannot write the state file {path}: {reason}; "
                             "choose another place with --state-file PATH.") from None


def _discard(tmp: Path) -> None:
    try:
        tmp.unlink(missing_ok=True)
    except OSError:
        pass


def _refuse_shared_folder(folder: Path) -> None:
    """The folder (if it exists) must belong to this user and be writable by no one else."""
    try:
        info = folder.stat()
    except FileNotFoundError:
        return                                     # created with mode 0700 by write_state_file
    except OSError as exc:
        raise StateFileError(f"cannot use the state file folder {folder}: {exc.strerror or exc}.") from None
    mode = stat.S_IMODE(info.st_mode)
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise StateFileError(f"the state file folder {folder} belongs to another user (uid {info.st_uid}); "
                             "give --state-file a path in a folder of your own, or leave it out.")
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise StateFileError(f"the state file folder {folder} can be written by other users (mode {mode:04o}), "
                             "who could replace the file and point DeskEye at their own server; use a folder "
                             f"only you can write (chmod 700 {folder}), or leave --state-file out.")


def remove_state_file(path: Path) -> None:
    """Remove the file if it is still ours (a newer worker may have replaced it)."""
    if _read_pid(path) == os.getpid():
        path.unlink(missing_ok=True)


def _refuse_live_owner(path: Path) -> None:
    pid = _read_pid(path)
    if pid is not None and pid != os.getpid() and _is_owner_alive(pid, path):
        raise StateFileError(f"another deskeye-worker (pid {pid}) owns the state file {path}; stop it, "
                             "or give this one its own --state-file PATH.")


def _read_pid(path: Path) -> int | None:
    try:
        pid = json.loads(path.read_text(encoding="utf-8")).get("pid")
    except (OSError, ValueError, AttributeError):
        return None
    return pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else None


def _is_owner_alive(pid: int, path: Path) -> bool:
    """True when process `pid` exists, is not a zombie, and started before `path` was last written: a pid reused
    after the worker was killed (kill -9 leaves its file behind) belongs to a process started later."""
    import psutil

    try:
        written_s = path.stat().st_mtime
        process = psutil.Process(pid)
        started_s = process.create_time()
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
    except (psutil.NoSuchProcess, FileNotFoundError):
        return False
    except (psutil.AccessDenied, OSError):
        return True                                # cannot tell: do not take the file over
    return started_s <= written_s + CREATE_TIME_SLACK_S
