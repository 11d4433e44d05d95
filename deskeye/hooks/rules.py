"""Automation hook rules: what `rules/hooks.toml` and the user's hooks.toml may say, validated at load.

    [[hook]]
    name = "unread-mail"
    title = "Unread mail"                          # optional; or a table: { en = "...", zh_CN = "...", zh_TW = "..." }
    match = ["unread", "new mail", "未读", "新邮件"]   # whole words or Chinese terms (see below); or regex = "..."
    needs = ["inbox", "收件箱"]                     # optional: fire only if one of these is also in the description
    run = ["/path/to/script"]                      # argv, no shell; the text arrives in DESKEYE_* and on stdin
                                                   # (notify-send and logger only: {summary} {object}
                                                   # {key_objects} after "--", see below)
    open_url = "https://mail.example.org"          # optional; http(s) only, from the rule, never from model text
    keys = ["ctrl", "shift", "m"]                  # optional key combination (pyautogui)
    text = "typed as written"                      # optional text to type (pyautogui); no placeholders
    notify = true                                  # optional desktop notification with the summary
    cooldown_s = 300                               # optional, default 60; per rule and per distinct object

Keywords match whole words, case-insensitively ("error" is not in "terrors"), and whole Chinese terms as a word
segmenter cuts the text (失败 is in 保存失败, 会议 is not in 会议室): `deskeye.hooks.terms` says exactly how.
`match` is looked for in each key object; `needs` in the summary and every key object. The key object that
matched (DESKEYE_OBJECT) is the first one, preferring one that holds no `needs` term: for an error dialog, its
message ("保存失败") rather than "Error dialog", since the message is what tells one dialog from another for the
cooldown (`deskeye.hooks.cooldowns`). The notification shows the rule's `title` in the user's language
(`deskeye.hooks.titles`).

Model text (the summary and the key objects, read off the screen by a model) is untrusted. A program
cannot be known to treat an argument as data: `sed -n -- {summary}` runs a sed script (`1e id`), `find -- {summary}`
an expression (`-delete`), `ssh host -- {summary}` a remote command, `vim -es` ex commands, and any program may be an
interpreter under another name. So model text reaches a command as data only, and the loader enforces it:
- every command gets it in the environment (DESKEYE_SUMMARY, DESKEYE_OBJECT, DESKEYE_KEY_OBJECTS as a JSON list,
  DESKEYE_HOOK) and as one JSON document on its standard input (see `deskeye.hooks.runner.hook_document`);
- a placeholder in `run` is allowed only for the programs in DATA_PROGRAMS (notify-send, logger), which take their
  operands as message text, and only in elements after a `--` element (the end of options), so text starting
  with `-` is never an option; the program must resolve (symlinks followed) to that program in a system folder
  (/usr/bin, /bin) that only root can change, and the rule then runs that resolved path. A symlink or a copy of
  an interpreter named `notify-send` is refused. Everything else with a placeholder is refused, naming the safe form;
- `regex` runs in RE2, a linear-time engine (a pattern such as `^(a+)+$` cannot block), case-insensitively.

Any mistake raises HookRuleError naming the file, the rule (name or index) and what is wrong.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any
from urllib.parse import urlsplit

import re2
import tomllib

from deskeye.errors import HookRuleError
from deskeye.files import read_regular_text
from deskeye.hooks.terms import TermText, normalise
from deskeye.hooks.titles import parse_title, title_in

KNOWN_KEYS = ("name", "title", "match", "regex", "needs", "run", "open_url", "keys", "text", "notify", "cooldown_s")
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
END_OF_OPTIONS = "--"
MAX_REGEX_CHARS = 1000
MAX_RULES_FILE_BYTES = 1 << 20     # a hooks file is a few KB; more is a mistake (or a device)
MAX_REGEX_MEMORY_BYTES = 1 << 20
#: the programs a placeholder may be passed to: each takes every operand after `--` as message text, never as an
#: option, a file, a script or a command (notify-send: GOption, operands are the title and body; logger:
#: getopt_long, operands are the message). Keep this list short: each entry must have been checked like that.
DATA_PROGRAMS = frozenset({"notify-send", "logger"})
#: where such a program must really live (after symlinks): folders only root can change
SYSTEM_PROGRAM_DIRS = ("/usr/bin", "/bin")
SAFE_FORM = ("pass model text through the environment or standard input instead: run = [\"/path/to/your-script\"] "
             "(no placeholders), where the script reads \"$DESKEYE_SUMMARY\", \"$DESKEYE_OBJECT\", "
             "\"$DESKEYE_KEY_OBJECTS\" (a JSON list) or the JSON document on its standard input "
             "({\"hook\", \"summary\", \"object\", \"key_objects\"}); for a notification use notify = true or "
             "run = [\"notify-send\", \"DeskEye\", \"--\", \"{summary}\"].")


@dataclass(frozen=True)
class HookRule:
    name: str
    source: str                        # the file it came from
    keywords: tuple[str, ...] = ()     # whole terms, `normalise`d; or
    regex: Any = None                  # a compiled RE2 pattern, searched case-insensitively
    needs: tuple[str, ...] = ()        # whole terms, one of which must also be in the summary or a key object
    titles: tuple[tuple[str, str], ...] = ()   # (language, readable title) pairs: see `deskeye.hooks.titles`
    run: tuple[str, ...] = ()          # argv template
    open_url: str = ""
    keys: tuple[str, ...] = ()
    text: str = ""
    notify: bool = False
    cooldown_s: float = DEFAULT_COOLDOWN_S

    def match(self, key_objects: list[str], summary: str = "") -> str | None:
        """The key object this rule fires on, or None (see the module's docstring for which one)."""
        texts = [TermText(obj) for obj in key_objects]
        hits = [(obj, text) for obj, text in zip(key_objects, texts) if self._finds(obj, text)]
        if not hits:
            return None
        if not self.needs:
            return hits[0][0]
        if not any(text.first_of(self.needs) for text in [TermText(summary), *texts]):
            return None
        return next((obj for obj, text in hits if text.first_of(self.needs) is None), hits[0][0])

    def _finds(self, obj: str, text: TermText) -> bool:
        if self.regex is not None:
            return bool(self.regex.search(obj))
        return text.first_of(self.keywords) is not None

    def title(self, language: str) -> str:
        """The readable title for a user of `language` ("en", "zh_CN", "zh_TW")."""
        return title_in(dict(self.titles), self.name, language)

    def describe(self) -> str:
        trigger = f"regex /{self.regex.pattern}/" if self.regex is not None else f"match {list(self.keywords)}"
        trigger += f" with one of {list(self.needs)}" if self.needs else ""
        actions = [f"run {list(self.run)}"] if self.run else []
        actions += [f"open {self.open_url}"] if self.open_url else []
        actions += [f"keys {'+'.join(self.keys)}"] if self.keys else []
        actions += [f"type {self.text!r}"] if self.text else []
        actions += [f"notify {self.title('en')!r}"] if self.notify else []
        return f"{self.name}: {trigger} -> {', '.join(actions)} (cooldown {self.cooldown_s:g} s)"


def load_rules(path: Path) -> list[HookRule]:
    """Read and validate one hooks file."""
    try:
        data = tomllib.loads(read_regular_text(Path(path), max_bytes=MAX_RULES_FILE_BYTES, what="hooks file",
                                               error=HookRuleError))
    except FileNotFoundError:
        raise HookRuleError(f"{path}: hooks file not found.") from None
    except OSError as exc:
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
        needs=_terms(table.get("needs"), "needs", fail), titles=tuple(parse_title(table.get("title"), fail).items()),
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
    return _terms(table.get("match"), "match", fail)


def _terms(words, key: str, fail) -> tuple[str, ...]:
    """A list of keywords, `normalise`d as the texts they are looked for in will be."""
    if words is None:
        return ()
    if not isinstance(words, list) or not words or not all(isinstance(w, str) and normalise(w) for w in words):
        fail(f"'{key}' must be a non-empty list of non-empty strings, e.g. {key} = [\"inbox\", \"邮件\"].")
    return tuple(dict.fromkeys(normalise(w) for w in words))


def _regex(table: dict, fail):
    if "regex" not in table:
        return None
    pattern = table["regex"]
    if not isinstance(pattern, str) or not pattern:
        fail("'regex' must be a non-empty string.")
    if len(pattern) > MAX_REGEX_CHARS:
        fail(f"'regex' is {len(pattern):,} characters; at most {MAX_REGEX_CHARS:,} are accepted.")
    options = re2.Options()
    options.case_sensitive = False
    options.log_errors = False
    options.max_mem = MAX_REGEX_MEMORY_BYTES
    try:
        return re2.compile(pattern, options)
    except re2.error as exc:
        reason = exc.args[0].decode("utf-8", "replace") if exc.args and isinstance(exc.args[0], bytes) else exc
        fail(f"bad regex {pattern!r}: {reason} (regexes run in RE2, a linear-time engine: no lookaround or "
             "backreferences).")


def _run(value, fail) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not value or not all(isinstance(a, str) for a in value):
        fail("'run' must be a non-empty list of strings (the program and its arguments, no shell), "
             "e.g. run = [\"notify-send\", \"DeskEye\", \"--\", \"{summary}\"].")
    if not value[0].strip():
        fail("'run' starts with an empty program name.")
    if PLACEHOLDER.search(value[0]):
        fail("the program (first element of 'run') cannot contain a placeholder; model text never picks the program.")
    if any("\x00" in a for a in value):
        fail("'run' contains a NUL character.")
    if not any(PLACEHOLDER.search(a) for a in value[1:]):
        return tuple(value)
    program, program_problems = _data_program(value[0])
    problems = program_problems + _options_problem(value)
    if problems:
        fail(" ".join(problems))
    return (program, *value[1:])        # the resolved path: what was checked is what runs, whatever PATH says later


def _options_problem(argv: list[str]) -> list[str]:
    """Model text must never be read as an option: placeholders only after `--`, never in an option's name."""
    end = argv.index(END_OF_OPTIONS) if END_OF_OPTIONS in argv else len(argv)
    for position, element in enumerate(argv[1:], start=1):
        if PLACEHOLDER.search(element) and (re.match(r"^-+\{", element) or position < end):
            return [f"'run' element {element!r} holds a placeholder before '--': model text starting with '-' "
                    "would reach the program as an option. Put \"--\" (the end of options) before the first "
                    "placeholder, e.g. run = [\"notify-send\", \"DeskEye\", \"--\", \"{summary}\"]."]
    return []


def _data_program(program: str) -> tuple[str, list[str]]:
    """(its real path, []) if `program` may take model text in its arguments; else ("", [why not and the fix])."""
    name = PurePath(program).name
    if name not in DATA_PROGRAMS:
        return "", [f"'run' puts model text in the arguments of {program!r}; DeskEye cannot know whether a program "
                    "runs its arguments as code or reads them as options, files or scripts (sed, find, ssh, vim, "
                    "xdg-open, shells and interpreters all do), so placeholders are allowed only for "
                    f"{' and '.join(sorted(DATA_PROGRAMS))}, after \"--\". To fix: {SAFE_FORM}"]
    real, why = _system_program(program)
    if why:
        return "", [f"{why} Placeholders are allowed only for the system's own {name}, which takes them as "
                    f"message text. To fix: name the system's {name} (e.g. {SYSTEM_PROGRAM_DIRS[0]}/{name}), "
                    f"or {SAFE_FORM}"]
    return real, []


def _system_program(program: str) -> tuple[str, str]:
    """(the real path of `program`, "") if it is the system's own copy of its name; else ("", why not).

    Symlinks are followed (a `notify-send` that links to python is python), and the file and its folder must be
    in SYSTEM_PROGRAM_DIRS, owned by root and writable by no one else: a copy of an interpreter renamed `logger`
    in a user's folder is not the system's logger."""
    found = shutil.which(program)
    if found is None:
        return "", f"{program!r} is not installed or not executable (looked up on PATH)."
    real = os.path.realpath(found)
    name, folder = PurePath(program).name, os.path.dirname(real)
    if PurePath(real).name != name:
        return "", f"{program!r} is really {real!r}, not {name}."
    if folder not in SYSTEM_PROGRAM_DIRS:
        return "", f"{program!r} is {real!r}, outside the system folders ({', '.join(SYSTEM_PROGRAM_DIRS)})."
    for path in (real, folder):
        info = os.stat(path)
        if info.st_uid != 0 or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return "", f"{path!r} can be changed by a user other than root."
    return real, ""


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
