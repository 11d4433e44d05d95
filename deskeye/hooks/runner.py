"""Firing automation hooks on a description's key_objects: commands, URLs, notifications, key presses.

Safety rules (model text is untrusted):
- a command is an argv list run WITHOUT a shell; model text reaches it as data: in the DESKEYE_SUMMARY,
  DESKEYE_OBJECT, DESKEYE_KEY_OBJECTS (JSON list) environment variables and as one JSON document on its
  standard input (`hook_document`); placeholders in argv exist only for the few programs `rules`
  allows (notify-send, logger, after `--`), filled by literal one-pass substitution (no str.format);
- URLs, keys and typed text come only from the rule; pyautogui is imported only when a hook has keys;
- a cooldown per hook and per distinct object (`cooldowns`) on a monotonic clock; dry-run runs nothing;
- a notification is titled with the hook's readable title in the user's language (`titles`), its body the summary;
- `fire()` never blocks: each firing runs on its own thread, its command is killed after
  `command_timeout_s` and reaped; `close()` stops what is still running;
- one JSON line per firing in the audit log (ASCII-escaped: model text cannot break the line).
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Callable

from deskeye.hooks.cooldowns import Cooldowns
from deskeye.hooks.rules import HookRule, fill_placeholders
from deskeye.hooks.titles import notification_title
from deskeye.language import ui_language

log = logging.getLogger(__name__)

_STDERR_TAIL_CHARS = 300
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass
class Firing:
    hook: str
    matched_object: str
    argv: list[str] | None          # the command as run (None: the hook has no command)
    dry_run: bool
    exit_code: int | None = None
    timed_out: bool = False
    errors: list[str] = field(default_factory=list)
    _done: threading.Event = field(default_factory=threading.Event, repr=False)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until every action of this firing has finished; False on timeout."""
        return self._done.wait(timeout_s)

    @property
    def is_done(self) -> bool:
        return self._done.is_set()

    @property
    def ok(self) -> bool:
        return not self.errors and self.exit_code in (None, 0)


def default_open_url(url: str) -> bool:
    import webbrowser
    return webbrowser.open(url)


def press_keys(keys: tuple[str, ...], text: str) -> None:
    """Press a key combination and/or type text with pyautogui (imported here: it needs a display)."""
    if sys.platform.startswith("linux") and not os.environ.get("DISPLAY"):
        raise RuntimeError("keys and text need an X display (DISPLAY is not set)")
    import pyautogui
    if keys:
        pyautogui.hotkey(*keys)
    if text:
        pyautogui.write(text, interval=0.01)


class HookRunner:
    def __init__(self, rules: list[HookRule], notifier=None, *, dry_run: bool = False,
                 audit_path: Path | None = None, clock: Callable[[], float] = time.monotonic,
                 command_timeout_s: float = 10.0, open_url: Callable[[str], bool] = default_open_url,
                 press: Callable[[tuple[str, ...], str], None] = press_keys,
                 on_firing: Callable[[Firing], None] = lambda firing: None, language: str | None = None):
        """`language` ("en", "zh_CN", "zh_TW") picks the notification titles; None = the one DeskEye speaks."""
        self.rules = list(rules)
        self.language = language or ui_language()
        self._notifier = notifier
        self.dry_run = dry_run
        self._audit_path = Path(audit_path) if audit_path else None
        self._command_timeout_s = command_timeout_s
        self._open_url = open_url
        self._press = press
        self._on_firing = on_firing
        self._cooldowns = Cooldowns(clock)
        self._lock = threading.Lock()              # running set, audit file
        self._running: set[subprocess.Popen] = set()
        self._threads: list[threading.Thread] = []
        self._closed = threading.Event()

    def fire(self, description) -> list[Firing]:
        """Start every matching hook that is not cooling down; returns at once (see Firing.wait)."""
        if self._closed.is_set():
            return []
        key_objects = [str(o) for o in description.key_objects]
        summary = str(description.summary)
        firings = []
        for rule in self.rules:
            matched = rule.match(key_objects, summary)
            if matched is None or not self._cooldowns.take(rule.name, rule.cooldown_s, matched):
                continue
            firing = Firing(rule.name, matched, None, self.dry_run)
            values = _values(summary, matched, key_objects)
            if rule.run:
                firing.argv = [fill_placeholders(part, values) for part in rule.run]
            thread = threading.Thread(target=self._execute, args=(rule, firing, values, key_objects),
                                      name=f"deskeye-hook-{rule.name}", daemon=True)
            with self._lock:
                self._threads = [t for t in self._threads if t.is_alive()] + [thread]
            thread.start()
            firings.append(firing)
        return firings

    def close(self, timeout_s: float = 5.0) -> None:
        """Fire nothing more; kill commands still running and wait for the firing threads."""
        self._closed.set()
        with self._lock:
            running, threads = list(self._running), list(self._threads)
        for proc in running:
            _kill(proc)
        deadline = time.monotonic() + timeout_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------ internals

    def _execute(self, rule: HookRule, firing: Firing, values: dict[str, str], key_objects: list[str]) -> None:
        started = time.monotonic()
        try:
            if not self.dry_run:
                self._act(rule, firing, values)
        except Exception as exc:  # noqa: BLE001 - recorded in the firing and the audit log
            firing.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            self._audit(rule, firing, key_objects, (time.monotonic() - started) * 1000)
            firing._done.set()
            try:
                self._on_firing(firing)
            except Exception:  # noqa: BLE001
                log.exception("on_firing callback failed")

    def _act(self, rule: HookRule, firing: Firing, values: dict[str, str]) -> None:
        proc = self._start(firing, values) if firing.argv else None
        if rule.notify and self._notifier is not None:
            title = notification_title(rule.title(self.language), self.language)
            if not self._notifier.notify(title, values["summary"] or values["object"]):
                firing.errors.append("notification not shown")
        if rule.open_url and not self._open_url(rule.open_url):
            firing.errors.append(f"could not open {rule.open_url}")
        if rule.keys or rule.text:
            self._guarded(firing, lambda: self._press(rule.keys, rule.text))
        if proc is not None:
            self._reap(proc, firing, hook_document(firing.hook, values))

    def _start(self, firing: Firing, values: dict[str, str]) -> subprocess.Popen | None:
        inherited = {name: value for name, value in os.environ.items() if not name.startswith("DESKEYE_")}
        env = {**inherited, "DESKEYE_HOOK": firing.hook, "DESKEYE_SUMMARY": values["summary"],   # these and no
               "DESKEYE_OBJECT": values["object"], "DESKEYE_KEY_OBJECTS": values["key_objects_json"]}  # other DESKEYE_
        try:
            proc = subprocess.Popen(firing.argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, shell=False, start_new_session=os.name == "posix")
        except OSError as exc:
            firing.errors.append(f"cannot run {firing.argv[0]!r}: {exc.strerror or exc}")
            return None
        with self._lock:
            self._running.add(proc)
            is_closing = self._closed.is_set()
        if is_closing:   # close() ran while we were starting it: it did not see this process
            _kill(proc)
        return proc

    def _reap(self, proc: subprocess.Popen, firing: Firing, document: bytes) -> None:
        """Write the JSON document to the command's stdin (a command that does not read it is fine), then wait."""
        try:
            _, stderr = proc.communicate(document, timeout=self._command_timeout_s)
        except subprocess.TimeoutExpired:
            firing.timed_out = True
            firing.errors.append(f"killed after {self._command_timeout_s:g} s")
            _kill(proc)
            try:
                _, stderr = proc.communicate(timeout=5)
            except subprocess.TimeoutExpired:   # a grandchild in its own session holds the pipe
                stderr = b""
                proc.stderr.close()
                proc.wait()
        finally:
            with self._lock:
                self._running.discard(proc)
        firing.exit_code = proc.returncode
        if proc.returncode and stderr:
            log.warning("hook %s: %s exited %d: %s", firing.hook, firing.argv[0], proc.returncode,
                        stderr.decode(errors="replace").strip()[-_STDERR_TAIL_CHARS:])

    @staticmethod
    def _guarded(firing: Firing, action: Callable[[], None]) -> None:
        try:
            action()
        except Exception as exc:  # noqa: BLE001 - pyautogui raises many kinds
            firing.errors.append(f"keys/text failed: {exc}")

    def _audit(self, rule: HookRule, firing: Firing, key_objects: list[str], elapsed_ms: float) -> None:
        record = {
            "time": datetime.now().astimezone().isoformat(timespec="seconds"), "hook": firing.hook,
            "object": firing.matched_object, "key_objects": key_objects, "argv": firing.argv,
            "open_url": rule.open_url or None, "keys": list(rule.keys) or None, "text": bool(rule.text),
            "notify": rule.notify, "dry_run": firing.dry_run, "exit_code": firing.exit_code,
            "timed_out": firing.timed_out, "errors": firing.errors, "elapsed_ms": round(elapsed_ms, 1),
        }
        line = json.dumps(record, ensure_ascii=True)   # \n, \u2028 and friends escaped: one line, always
        log.info("hook fired: %s", line)
        if self._audit_path is None:
            return
        try:
            with self._lock:
                self._audit_path.parent.mkdir(parents=True, exist_ok=True)
                with self._audit_path.open("a", encoding="ascii") as f:
                    f.write(line + "\n")
        except OSError as exc:
            log.warning("cannot write the hook audit log %s: %s", self._audit_path, exc)


def _values(summary: str, matched: str, key_objects: list[str]) -> dict[str, str]:
    """The texts a command receives. NUL characters (which no argv or environment can hold) are dropped and
    lone surrogates (which no UTF-8 can hold) become U+FFFD, so odd model output cannot stop the command."""
    def clean(text: str) -> str:
        return _LONE_SURROGATE.sub("\ufffd", text.replace("\x00", ""))
    cleaned = [clean(o) for o in key_objects]
    return {"summary": clean(summary), "object": clean(matched), "key_objects": ", ".join(cleaned),
            "key_objects_json": json.dumps(cleaned, ensure_ascii=False)}


def hook_document(hook: str, values: dict[str, str]) -> bytes:
    """What a command reads on stdin: one JSON object and a newline, UTF-8:
    {"hook": name, "summary": text, "object": the matched key object, "key_objects": [all of them]}."""
    document = {"hook": hook, "summary": values["summary"], "object": values["object"],
                "key_objects": json.loads(values["key_objects_json"])}
    return (json.dumps(document, ensure_ascii=False) + "\n").encode("utf-8")


def _kill(proc: subprocess.Popen) -> None:
    """Kill the command and everything it started (its own process group on POSIX)."""
    if proc.returncode is not None:
        return
    try:
        if os.name == "posix":
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except (ProcessLookupError, PermissionError, OSError):
        pass
