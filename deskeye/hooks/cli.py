"""`deskeye hooks check` and `deskeye hooks fire`: validate the rules, or fire them once as the app would."""

from __future__ import annotations

import json

from deskeye.errors import UsageError
from deskeye.hooks.loading import build_runner, rule_files
from deskeye.hooks.rules import load_rules
from deskeye.hooks.runner import Firing


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
    from deskeye.prompt import Description
    from deskeye.ui.notify import Notifier
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
