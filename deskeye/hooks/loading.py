"""The app's hooks from its settings: which rule files (DeskEye's defaults, then the user's), the rules they
hold, the audit log, and the runner built from them.

The rule format and its validation (model text reaches a command only as data) live in
`deskeye.hooks.rules`; firing (commands without a shell, the text in their environment and as JSON on
their stdin, URLs, notifications, keys, cooldowns, audit log) in `deskeye.hooks.runner`.
"""

from __future__ import annotations

from pathlib import Path

from deskeye.errors import HookRuleError
from deskeye.hooks.rules import HookRule, load_rules
from deskeye.hooks.runner import HookRunner

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
