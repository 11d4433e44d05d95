"""Automation hook rules: what `rules/hooks.toml` and the user's hooks.toml may say, validated at load.

    [[hook]]
    name = "unread-mail"
    match = ["email", "inbox", "邮件"]             # keywords (substring, case-insensitive); or regex = "..."
    run = ["notify-send", "DeskEye", "{summary}"]  # argv; {summary} {object} {key_objects} are filled in
                                                   # ({key_objects}: all of them joined by ", ")
    open_url = "https://mail.example.org"          # optional; http(s) only, from the rule, never from model text
    keys = ["ctrl", "shift", "m"]                  # optional key combination (pyautogui)
    text = "typed as written"                      # optional text to type (pyautogui); no placeholders
    notify = true                                  # optional desktop notification with the summary
    cooldown_s = 300                               # optional, default 60

Any mistake raises HookRuleError naming the file, the rule (name or index) and what is wrong.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import tomllib

from deskeye.errors import HookRuleError

KNOWN_KEYS = ("name", "match", "regex", "run", "open_url", "keys", "text", "notify", "cooldown_s")
DEFAULT_COOLDOWN_S = 60.0
PLACEHOLDER = re.compile(r"\{(summary|object|key_objects)\}")
MAX_KEYS = 6
_NAMED_KEYS = frozenset(
    "ctrl ctrlleft ctrlright shift shiftleft shiftright alt altleft altright option optionleft optionright "
    "command win winleft winright super fn enter return tab space esc escape backspace delete del insert home "
    "end pageup pagedown pgup pgdn up down left right printscreen prtsc capslock numlock scrolllock pause "
    "volumeup volumedown volumemute playpause nexttrack prevtrack".split()
    + [f"f{i}" for i in range(1, 25)])
_SINGLE_KEY = re.compile(r"^[a-z0-9`\-=\[\]\\;',./]$")


@dataclass(frozen=True)
class HookRule:
    name: str
    source: str                        # the file it came from
    keywords: tuple[str, ...] = ()     # casefolded substrings; or
    regex: re.Pattern | None = None    # searched case-insensitively
    run: tuple[str, ...] = ()          # argv template
    open_url: str = ""
    keys: tuple[str, ...] = ()
    text: str = ""
    notify: bool = False
    cooldown_s: float = DEFAULT_COOLDOWN_S

    def match(self, key_objects: list[str]) -> str | None:
        """The first key object this rule matches, or None."""
        for obj in key_objects:
            if self.regex is not None:
                if self.regex.search(obj):
                    return obj
            elif any(word in obj.casefold() for word in self.keywords):
                return obj
        return None

    def describe(self) -> str:
        trigger = f"regex /{self.regex.pattern}/" if self.regex is not None else f"match {list(self.keywords)}"
        actions = [f"run {list(self.run)}"] if self.run else []
        actions += [f"open {self.open_url}"] if self.open_url else []
        actions += [f"keys {'+'.join(self.keys)}"] if self.keys else []
        actions += [f"type {self.text!r}"] if self.text else []
        actions += ["notify"] if self.notify else []
        return f"{self.name}: {trigger} -> {', '.join(actions)} (cooldown {self.cooldown_s:g} s)"


def load_rules(path: Path) -> list[HookRule]:
    """Read and validate one hooks file."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise HookRuleError(f"{path}: hooks file not found.") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise HookRuleError(f"{path}: cannot read the hooks file ({exc}).") from None
    except tomllib.TOMLDecodeError as exc:
        raise HookRuleError(f"{path}: not valid TOML ({exc}).") from None
    return parse_rules(data, str(path))


def parse_rules(data: dict, source: str) -> list[HookRule]:
    extra = sorted(set(data) - {"hook"})
    if extra:
        raise HookRuleError(f"{source}: unknown top-level key(s) {', '.join(extra)}; rules go in [[hook]] tables.")
    tables = data.get("hook", [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise HookRuleError(f"{source}: 'hook' must be an array of tables ([[hook]] sections).")
    rules, names = [], set()
    for index, table in enumerate(tables, start=1):
        rule = _parse_rule(table, source, index)
        if rule.name in names:
            raise HookRuleError(f"{source}: hook #{index} ({rule.name!r}): the name is used twice; "
                                "names must be unique.")
        names.add(rule.name)
        rules.append(rule)
    return rules


def _parse_rule(table: dict, source: str, index: int) -> HookRule:
    name = table.get("name")
    where = f"{source}: hook #{index}" + (f" ({name!r})" if isinstance(name, str) and name else "")

    def fail(what: str):
        raise HookRuleError(f"{where}: {what}")

    unknown = sorted(set(table) - set(KNOWN_KEYS))
    if unknown:
        fail(f"unknown key(s) {', '.join(unknown)}; known keys: {', '.join(KNOWN_KEYS)}.")
    if not isinstance(name, str) or not name.strip():
        fail("'name' is missing; give every hook a short unique name.")
    rule = HookRule(
        name=name.strip(), source=source,
        keywords=_keywords(table, fail), regex=_regex(table, fail),
        run=_run(table.get("run"), fail), open_url=_url(table.get("open_url"), fail),
        keys=_keys(table.get("keys"), fail), text=_text(table.get("text"), fail),
        notify=_bool(table.get("notify", False), "notify", fail), cooldown_s=_cooldown(table.get("cooldown_s"), fail),
    )
    if not (rule.run or rule.open_url or rule.keys or rule.text or rule.notify):
        fail("the hook does nothing: give it run, open_url, keys, text or notify = true.")
    return rule


def _keywords(table: dict, fail) -> tuple[str, ...]:
    has_match, has_regex = "match" in table, "regex" in table
    if has_match and has_regex:
        fail("give either 'match' (keywords) or 'regex', not both.")
    if not has_match and not has_regex:
        fail("missing 'match' (a list of keywords) or 'regex' (a pattern): the hook would never fire.")
    if not has_match:
        return ()
    words = table["match"]
    if not isinstance(words, list) or not words or not all(isinstance(w, str) and w.strip() for w in words):
        fail("'match' must be a non-empty list of non-empty strings, e.g. match = [\"inbox\", \"邮件\"].")
    return tuple(w.strip().casefold() for w in words)


def _regex(table: dict, fail) -> re.Pattern | None:
    if "regex" not in table:
        return None
    pattern = table["regex"]
    if not isinstance(pattern, str) or not pattern:
        fail("'regex' must be a non-empty string.")
    try:
        return re.compile(pattern, re.IGNORECASE)
    except re.error as exc:
        fail(f"bad regex {pattern!r}: {exc}.")


def _run(value, fail) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not value or not all(isinstance(a, str) for a in value):
        fail("'run' must be a non-empty list of strings (the program and its arguments, no shell), "
             "e.g. run = [\"notify-send\", \"DeskEye\", \"{summary}\"].")
    if not value[0].strip():
        fail("'run' starts with an empty program name.")
    if PLACEHOLDER.search(value[0]):
        fail("the program (first element of 'run') cannot contain a placeholder; model text never picks the program.")
    if any("\x00" in a for a in value):
        fail("'run' contains a NUL character.")
    return tuple(value)


def _url(value, fail) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        fail("'open_url' must be a string.")
    parts = urlsplit(value)
    if parts.scheme.lower() not in ("http", "https") or not parts.netloc:
        fail(f"'open_url' must be an http:// or https:// URL with a host; got {value!r}.")
    if re.search(r"[\s\x00-\x1f{}]", value):
        fail("'open_url' may not contain spaces, control characters or placeholders; URLs come only from the rule.")
    return value


def _keys(value, fail) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not value or not all(isinstance(k, str) for k in value):
        fail("'keys' must be a non-empty list of key names, e.g. keys = [\"ctrl\", \"shift\", \"m\"].")
    if len(value) > MAX_KEYS:
        fail(f"'keys' has {len(value)} keys; a combination has at most {MAX_KEYS}.")
    keys = tuple(k.strip().lower() for k in value)
    bad = [k for k in keys if k not in _NAMED_KEYS and not _SINGLE_KEY.match(k)]
    if bad:
        fail(f"unknown key name(s) {bad}; use single characters or names such as ctrl, shift, alt, enter, f5.")
    return keys


def _text(value, fail) -> str:
    if value is None:
        return ""
    if not isinstance(value, str) or not value:
        fail("'text' must be a non-empty string.")
    if PLACEHOLDER.search(value):
        fail("'text' is typed exactly as written; placeholders are not filled there (model text is never typed).")
    return value


def _bool(value, key: str, fail) -> bool:
    if not isinstance(value, bool):
        fail(f"'{key}' must be true or false.")
    return value


def _cooldown(value, fail) -> float:
    if value is None:
        return DEFAULT_COOLDOWN_S
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:   # also rejects nan
        fail(f"'cooldown_s' must be a number of seconds >= 0; got {value!r}.")
    return float(value)


def fill_placeholders(template: str, values: dict[str, str]) -> str:
    """Replace {summary}, {object}, {key_objects} literally, in one pass (inserted text is never rescanned)."""
    return PLACEHOLDER.sub(lambda m: values[m.group(1)], template)
