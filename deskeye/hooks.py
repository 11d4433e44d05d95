"""Automation hooks: load the rules (DeskEye's defaults, then the user's file), build the runner, and
the `deskeye hooks check` / `deskeye hooks fire` commands.

The rule format and its validation (model text reaches a command only as data) live in
`deskeye.hook_rules`; firing (commands without a shell, the text in their environment and as JSON on
their stdin, URLs, notifications, keys, cooldowns, audit log) in `deskeye.hook_runner`.
"""

from __future__ import annotations

import json
from pathlib import Path

from deskeye.errors import HookRuleError, UsageError
from deskeye.hook_rules import HookRule, load_rules
from deskeye.hook_runner import Firing, HookRunner

__all__ = ["HookRule", "HookRunner", "Firing", "load_rules", "rule_files", "load_hook_rules", "build_runner",
           "audit_log_path", "cmd_check", "cmd_fire"]

RULES_FILE_NAME = "hooks.toml"


def rule_files(settings) -> list[Path]:
    """DeskEye's defaults (rules/hooks.toml) and the user's file, in that order; missing defaults are skipped."""
    files = []
    defaults = settings.rules_dir / RULES_FILE_NAME
    if defaults.is_file():
        files.append(defaults)
    if settings.hooks.rules_file:
        user = Path(settings.hooks.rules_file).expanduser()
        if not user.is_file():
            raise HookRuleError(f"{user}: hooks file not found (hooks.rules_file in settings).")
        files.append(user)
    elif (settings.config_dir / RULES_FILE_NAME).is_file():
        files.append(settings.config_dir / RULES_FILE_NAME)
    return files


def load_hook_rules(settings, rules_file: Path | None = None) -> list[HookRule]:
    """The rules the app uses: `rules_file` alone if given, else the defaults overridden by name by the user's."""
    if rules_file is not None:
        return load_rules(rules_file)
    by_name: dict[str, HookRule] = {}
    for path in rule_files(settings):
        for rule in load_rules(path):
            by_name[rule.name] = rule
    return list(by_name.values())


def audit_log_path(settings) -> Path:
    if settings.hooks.audit_log:
        return Path(settings.hooks.audit_log).expanduser()
    import platformdirs
    return Path(platformdirs.user_log_dir("deskeye", appauthor=False)) / "hooks.log"


def build_runner(settings, notifier=None, *, rules_file: Path | None = None, dry_run: bool = False,
                 **kwargs) -> HookRunner:
    """The app's HookRunner: rules, audit log and timeouts from settings."""
    rules = load_hook_rules(settings, rules_file) if settings.hooks.enabled or rules_file else []
    return HookRunner(rules, notifier, dry_run=dry_run or settings.hooks.dry_run, audit_path=audit_log_path(settings),
                      command_timeout_s=settings.hooks.command_timeout_s, **kwargs)


# ---------------------------------------------------------------- CLI

def cmd_check(args, settings) -> int:
    """`deskeye hooks check [--rules FILE]`: validate, one line per rule; a bad file exits 2 with the reason."""
    files = [args.rules] if args.rules else rule_files(settings)
    if not files:
        print("no hook files (rules/hooks.toml or the user's hooks.toml)")
        return 0
    for path in files:
        rules = load_rules(path)
        print(f"{path}: {len(rules)} rule(s) OK")
        for rule in rules:
            print(f"  {rule.describe()}")
    return 0


def cmd_fire(args, settings) -> int:
    """`deskeye hooks fire --key-objects JSON [--summary TEXT] [--dry-run]`: run the matching hooks once."""
    key_objects = _parse_key_objects(args.key_objects)
    from deskeye.notify import Notifier
    from deskeye.prompt import Description
    runner = build_runner(settings, Notifier(), rules_file=args.rules, dry_run=args.dry_run)
    firings = runner.fire(Description(args.summary, key_objects))
    for firing in firings:
        firing.wait(settings.hooks.command_timeout_s + 30)
    runner.close()
    if not firings:
        disabled = "" if settings.hooks.enabled or args.rules else " (hooks are off: hooks.enabled = false)"
        print(f"no hook matched {json.dumps(key_objects, ensure_ascii=False)}{disabled}")
    for firing in firings:
        print(_firing_line(firing))
    return 0 if all(f.ok for f in firings) else 1


def _parse_key_objects(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError("--key-objects must be a JSON list of strings, e.g. '[\"inbox\", \"3 unread\"]' "
                         f"({exc.msg}).") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UsageError("--key-objects must be a JSON list of strings, e.g. '[\"inbox\", \"3 unread\"]'.")
    return value


def _firing_line(firing: Firing) -> str:
    verb = "would fire" if firing.dry_run else "fired"
    text = f"{verb} {firing.hook} on {json.dumps(firing.matched_object, ensure_ascii=False)}"
    if firing.argv is not None:
        text += f": run {json.dumps(firing.argv, ensure_ascii=False)}"
        if not firing.dry_run:
            text += f" -> exit {firing.exit_code}"
    if firing.errors:
        text += f" [{'; '.join(firing.errors)}]"
    return text
