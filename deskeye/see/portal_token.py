"""The ScreenCast restore token: what lets the desktop skip its "may DeskEye see the screen?" dialog after the
user's first yes.

The portal (ScreenCast version 4+, `persist_mode=2`) hands a token back from Start; given to the next SelectSources
it restores the same source without asking. Each token is used up when it is given: every Start answers a new one,
which replaces the old at once. It lives in DeskEye's state folder (`$XDG_STATE_HOME/deskeye`, mode 0700) in a file of
mode 0600: whoever reads it may see the screen without asking the user, like DeskEye.

The token comes from a D-Bus reply: it is kept only where it is a short string of plain characters (the portal's
are UUIDs), never used as a path or a shell word.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from deskeye.errors import DeskEyeError
from deskeye.files import read_regular_text, write_file_atomically

log = logging.getLogger(__name__)

TOKEN_FILE = "screencast-restore-token"                  # the shared monitor's
WINDOW_TOKEN_FILE = "screencast-window-restore-token"    # the shared window's (capture.source = "window")
MAX_TOKEN_CHARS = 256
_TOKEN = re.compile(r"[A-Za-z0-9_.:-]{1,%d}" % MAX_TOKEN_CHARS)


def state_folder() -> Path:
    """DeskEye's state folder ($XDG_STATE_HOME/deskeye on Linux)."""
    import platformdirs
    return Path(platformdirs.user_state_dir("deskeye", appauthor=False))


def token_path(source: str = "monitor") -> Path:
    return state_folder() / (WINDOW_TOKEN_FILE if source == "window" else TOKEN_FILE)


def is_token(text: str) -> bool:
    return bool(_TOKEN.fullmatch(text))


def load_token(path: Path | None = None) -> str:
    """The saved token, or "" (none yet, or a file that is not one: the desktop then asks the user again)."""
    path = path or token_path()
    try:
        text = read_regular_text(path, max_bytes=MAX_TOKEN_CHARS + 1, what="screen-cast restore token",
                                 error=DeskEyeError).strip()
    except FileNotFoundError:
        return ""
    except DeskEyeError as exc:
        log.warning("%s The desktop will ask again whether DeskEye may see the screen.", exc)
        return ""
    if not is_token(text):
        log.warning("%s does not hold a restore token; the desktop will ask again whether DeskEye may see the "
                    "screen.", path)
        return ""
    return text


def save_token(token: str, path: Path | None = None) -> None:
    """Keep `token` (mode 0600, folder 0700) for the next start; a failure is logged, never fatal: the desktop
    then asks once more."""
    path = path or token_path()
    if not is_token(token):
        log.warning("the screen-cast portal answered a restore token DeskEye does not keep (%d characters)",
                    len(token))
        return
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_file_atomically(path, token.encode("ascii"))     # a temp file of mode 0600, renamed over the old
        os.chmod(path, 0o600)
    except OSError as exc:
        log.warning("cannot keep the screen-cast restore token in %s (%s): the desktop will ask again next time",
                    path, exc.strerror or exc)
