"""Settings that apply while DeskEye runs: the running app watches its settings file, re-reads and checks it when it
changes, applies what can be applied at once and says which changed keys wait for a restart.

- Watching is a poll: one `os.stat` of one small file every POLL_S, on the thread `deskeye-settings` (stopped with
  the app). It costs nothing measurable, needs no library, and sees every way a file gets changed (an editor's
  save-and-rename, `sed -i`, a swapped symlink), where inotify watches one inode and loses it on a rename.
- What applies at once (`applies_live`): what DeskEye shows and what it watches, the [overlay] section and [capture]
  except its monitor (the overlay sits on the monitor it started on). Every other key starts a process, loads data or
  binds keys (the worker and its model, hotkeys, router, quick-answer providers, hooks, memory): a change to one is
  pending until DeskEye restarts, the user is told so once, and `deskeye settings` lists it.
- A bad edit changes nothing: the settings in effect stay, and the user is told once what is wrong (the error names
  the key and what it allows), after the file has stayed bad for one poll (an editor halfway through a save is no
  error).
- What is in effect goes to the run state: RUN_STATE_NAME in the app's run folder (deskeye/lifecycle.py; the file is
  0600 in a 0700 folder), which `deskeye settings` reads (`running_settings`) to show the running app's values.

The user-visible sentences are the *_MESSAGE constants below, so a translation pass finds them in one place.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from deskeye.errors import SettingsError
from deskeye.lifecycle import run_folders
from deskeye.files import read_regular_text, write_file_atomically
from deskeye.settings import Settings, load_settings, settings_from_dict, with_overrides

log = logging.getLogger(__name__)

POLL_S = 1.0                     # how often the running app looks at its settings file
JOIN_TIMEOUT_S = 2.0
RUN_STATE_NAME = "settings-in-effect.json"
MAX_RUN_STATE_BYTES = 1 << 20
MAX_LISTED_KEYS = 4              # a notice names at most this many keys, then "and N more"

LIVE_SECTIONS = frozenset({"overlay", "capture"})
RESTART_KEYS = frozenset({"capture.monitor"})

APPLIED_MESSAGE = "Settings applied: {changes}."
RESTART_ONE_MESSAGE = "{keys} changed: restart DeskEye to use it."
RESTART_MANY_MESSAGE = "{keys} changed: restart DeskEye to use them."
MORE_KEYS_MESSAGE = "{listed} and {num_more} more"
FIXED_MESSAGE = "The settings file is fine again; the settings in effect did not change."
INVALID_MESSAGE = "The settings file was not used: {error} The settings in effect stay as they were until it is fixed."

FileSignature = tuple[int, int, int] | None      # (inode, size, mtime in ns); None: no file
_UNSET = object()


def applies_live(key: str) -> bool:
    """Whether the running app takes a new value of `key` ("overlay.font_size") at once; else it needs a restart."""
    return key.split(".", 1)[0] in LIVE_SECTIONS and key not in RESTART_KEYS


def settings_sections(settings: Settings) -> dict[str, dict[str, Any]]:
    """The settings as plain data, section by section (what the run state holds)."""
    return {f.name: dataclasses.asdict(getattr(settings, f.name))
            for f in dataclasses.fields(settings) if f.name != "config_dir"}


def flat_settings(settings: Settings) -> dict[str, Any]:
    """{"overlay.font_size": 11, ...}: every key of the settings with its value."""
    return {f"{section}.{name}": value for section, values in settings_sections(settings).items()
            for name, value in values.items()}


def with_values(settings: Settings, values: dict[str, Any]) -> Settings:
    """A copy of `settings` with some keys ("section.name") replaced, checked like the file."""
    by_section: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        section, name = key.split(".", 1)
        by_section.setdefault(section, {})[name] = value
    return with_overrides(settings, **by_section)


@dataclass(frozen=True)
class SettingsUpdate:
    """What one change of the settings file means for the running app."""
    in_effect: Settings                                   # now in effect (as before, after a bad edit)
    applied: tuple[str, ...] = ()                         # keys whose new value is in effect now
    pending: dict[str, Any] = field(default_factory=dict)   # key -> the file's value, waiting for a restart
    newly_pending: tuple[str, ...] = ()                   # of those, the ones the user has not been told about
    error: str = ""                                       # why the file was not used ("" = it was)
    fixed: bool = False                                   # the file was bad before this change

    @property
    def message(self) -> str:
        """What to tell the user ("" = nothing): the error, or what was applied and what needs a restart."""
        if self.error:
            return INVALID_MESSAGE.format(error=self.error)
        values = flat_settings(self.in_effect)
        lines = []
        if self.applied:
            lines.append(APPLIED_MESSAGE.format(changes=_listed(
                [f"{key} = {_shown_value(values[key])}" for key in self.applied])))
        if self.newly_pending:
            template = RESTART_ONE_MESSAGE if len(self.newly_pending) == 1 else RESTART_MANY_MESSAGE
            lines.append(template.format(keys=_listed(list(self.newly_pending))))
        if self.fixed and not lines:
            lines.append(FIXED_MESSAGE)
        return "\n".join(lines)


def _listed(items: list[str]) -> str:
    if len(items) <= MAX_LISTED_KEYS:
        return ", ".join(items)
    return MORE_KEYS_MESSAGE.format(listed=", ".join(items[:MAX_LISTED_KEYS]), num_more=len(items) - MAX_LISTED_KEYS)


def _shown_value(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def settle(in_effect: Settings, file_at_start: Settings, file_now: Settings) -> SettingsUpdate:
    """The settings file now holds `file_now`: the live keys whose value differs from what is in effect are applied;
    the others that differ from the file the app started with are pending a restart. Keys the command line set
    (`--model`) differ from the file from the start, so they stay as they are unless the file changes them."""
    now, effect, start = flat_settings(file_now), flat_settings(in_effect), flat_settings(file_at_start)
    applied = tuple(key for key in now if applies_live(key) and now[key] != effect.get(key))
    pending = {key: now[key] for key in now if not applies_live(key) and now[key] != start.get(key)}
    settings = with_values(in_effect, {key: now[key] for key in applied}) if applied else in_effect
    return SettingsUpdate(settings, applied, pending)


def file_signature(path: Path) -> FileSignature:
    """What tells a changed file from an unchanged one without reading it; None when there is no file."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_ino, info.st_size, info.st_mtime_ns


class SettingsWatcher:
    """Watches the settings file of a running app: `start(on_update)` calls `on_update(SettingsUpdate)` on the
    thread `deskeye-settings` whenever a change of the file means something to apply or to tell."""

    def __init__(self, path: Path, settings: Settings, *, state_file: Path | None = None, poll_s: float = POLL_S):
        self.path = path
        self.state_file = state_file         # the run state; None: none written
        self.poll_s = poll_s
        self._in_effect = settings
        self._seen = file_signature(path)    # the file as last used (or told bad)
        self._suspect: FileSignature = None  # a bad file seen once: told if it is still so at the next poll
        self._file_at_start = self._load_or(settings)
        self._pending: dict[str, Any] = {}
        self._told_pending: dict[str, Any] = {}
        self._error = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def in_effect(self) -> Settings:
        return self._in_effect

    def start(self, on_update: Callable[[SettingsUpdate], None]) -> None:
        self.write_state()
        self._thread = threading.Thread(target=self._watch, args=(on_update,), name="deskeye-settings", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(JOIN_TIMEOUT_S)

    def _watch(self, on_update: Callable[[SettingsUpdate], None]) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                update = self.poll()
                if update is not None:
                    on_update(update)
            except Exception:                 # the watcher must live on: the next save may be fine
                log.exception("applying the changed settings failed")

    def poll(self) -> SettingsUpdate | None:
        """One look at the file (the watching thread calls it): the update to apply and tell, or None."""
        signature = file_signature(self.path)
        if signature == self._seen:
            return None
        try:
            update = settle(self._in_effect, self._file_at_start, load_settings(self.path))
        except SettingsError as exc:
            return self._bad_file(signature, str(exc))
        newly = tuple(key for key, value in update.pending.items() if self._told_pending.get(key, _UNSET) != value)
        update = dataclasses.replace(update, newly_pending=newly, fixed=bool(self._error))
        self._seen, self._suspect, self._error = signature, None, ""
        self._in_effect, self._pending, self._told_pending = update.in_effect, update.pending, dict(update.pending)
        self.write_state()
        return update if update.message else None

    def _bad_file(self, signature: FileSignature, error: str) -> SettingsUpdate | None:
        if signature != self._suspect:       # maybe an editor halfway through a save: look again next poll
            self._suspect = signature
            return None
        self._seen, self._error = signature, error
        self.write_state()
        return SettingsUpdate(self._in_effect, pending=self._pending, error=error)

    def _load_or(self, settings: Settings) -> Settings:
        try:
            return load_settings(self.path)
        except SettingsError:                # the app was given settings that are not this file's
            return settings

    def write_state(self) -> None:
        """The settings in effect, those pending a restart and the file's error, for `deskeye settings`."""
        if self.state_file is None:
            return
        document = {"pid": os.getpid(), "settings_file": str(_resolved(self.path)),
                    "in_effect": settings_sections(self._in_effect), "pending_restart": self._pending,
                    "file_error": self._error}
        try:
            write_file_atomically(self.state_file, json.dumps(document, ensure_ascii=False, indent=1).encode())
        except OSError as exc:               # a full disk: the app runs on, `deskeye settings` shows the file
            log.warning("cannot write %s: %s", self.state_file, exc.strerror or exc)


# ---------------------------------------------------------------------- `deskeye settings` reading the run state


@dataclass(frozen=True)
class RunningSettings:
    """The settings of a running `deskeye run`, as its run state says."""
    pid: int
    in_effect: Settings
    pending: dict[str, Any]                  # key -> the file's value, waiting for a restart
    file_error: str                          # the file's last change was not used, for this reason


def running_settings(path: Path) -> RunningSettings | None:
    """The settings in effect in this user's running DeskEye that uses the settings file `path` (the newest, if
    several run), else None."""
    target = str(_resolved(path))
    found: list[tuple[int, dict]] = []
    for folder in run_folders():
        state = folder / RUN_STATE_NAME
        try:
            document = json.loads(read_regular_text(state, max_bytes=MAX_RUN_STATE_BYTES, what="run state"))
            modified = os.stat(state).st_mtime_ns
        except (OSError, SettingsError, ValueError):
            continue                         # no state (yet), or one being replaced: not a running app's
        if isinstance(document, dict) and document.get("settings_file") == target and _is_running(document.get("pid")):
            found.append((modified, document))
    for _, document in sorted(found, key=lambda item: item[0], reverse=True):
        try:
            in_effect = settings_from_dict(document["in_effect"], source="run state", config_dir=Path(target).parent)
        except (SettingsError, KeyError, TypeError):
            continue                         # written by another version of DeskEye
        return RunningSettings(int(document["pid"]), in_effect, dict(document.get("pending_restart") or {}),
                               str(document.get("file_error") or ""))
    return None


def _resolved(path: Path) -> Path:
    return Path(path).expanduser().resolve()


def _is_running(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:                  # another user's process took the number: not our app
        return False
    return True
