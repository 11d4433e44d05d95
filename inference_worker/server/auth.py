"""The worker's bearer key and the state file that tells the app (only the same user) where to find it.

The key is given (--api-key) or generated per launch. The state file holds
`{"url", "api_key", "pid", "model", "engine"}`; it is created with mode 0600 in a 0700 folder, replaced
atomically (a reader never sees half a file) and removed on clean exit.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
from pathlib import Path

STATE_FILE_NAME = "worker.json"


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
    """Write `state` as JSON readable only by this user. Refuses to replace a live worker's file."""
    _refuse_live_owner(path)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(state, out)
        os.replace(tmp, path)
    except OSError as exc:
        raise StateFileError(f"cannot write the state file {path}: {exc.strerror or exc}; "
                             "choose another place with --state-file PATH.") from None


def remove_state_file(path: Path) -> None:
    """Remove the file if it is still ours (a newer worker may have replaced it)."""
    if _read_pid(path) == os.getpid():
        path.unlink(missing_ok=True)


def _refuse_live_owner(path: Path) -> None:
    pid = _read_pid(path)
    if pid is not None and pid != os.getpid() and _is_alive(pid):
        raise StateFileError(f"another deskeye-worker (pid {pid}) owns the state file {path}; stop it, "
                             "or give this one its own --state-file PATH.")


def _read_pid(path: Path) -> int | None:
    try:
        pid = json.loads(path.read_text(encoding="utf-8")).get("pid")
    except (OSError, ValueError, AttributeError):
        return None
    return pid if isinstance(pid, int) and not isinstance(pid, bool) else None


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
