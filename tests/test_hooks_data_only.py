"""Model text reaches a hook only as data: rules that put it in the arguments of a program that may read them
as code, options, files or scripts are refused when they load (and by `deskeye hooks check`) with the safe form;
a real hook receives hostile text intact in its environment and a JSON document on stdin, and nothing else runs;
the two allowed programs (notify-send, logger) take it as message text; the default rules still load and fire."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from deskeye.cli import main as deskeye_main
from deskeye.errors import HookRuleError
from deskeye.hooks.rules import HookRule, load_rules
from deskeye.hooks.loading import load_hook_rules
from deskeye.hooks.runner import HookRunner
from deskeye.ui.notify import Notifier
from deskeye.prompt import Description
from deskeye.settings import load_settings

pytestmark = [pytest.mark.subprocess]

SAFE_FORM_WORDS = ("$DESKEYE_SUMMARY", "standard input", "run = [\"/path/to/your-script\"]")


def write_rule(tmp_path: Path, run: list[str], name: str = "trial") -> Path:
    path = tmp_path / "hooks.toml"
    path.write_text(f'[[hook]]\nname = "{name}"\nmatch = ["inbox"]\nrun = {json.dumps(run)}\n', encoding="utf-8")
    return path


def fire_and_wait(runner: HookRunner, description: Description):
    firings = runner.fire(description)
    for firing in firings:
        assert firing.wait(30), f"hook {firing.hook} did not finish"
    runner.close()
    return firings


def python_under_another_name(tmp_path: Path, name: str, *, copy: bool = False) -> str:
    """An interpreter renamed: a symlink to this Python, or a copy of its binary, called `name`."""
    path = tmp_path / "bin" / name
    path.parent.mkdir(exist_ok=True)
    if copy:
        shutil.copy2(os.path.realpath(sys.executable), path)
    else:
        path.symlink_to(sys.executable)
    return str(path)


# ------------------------------------------------------------------ refused when the rules load

TRIAL_FORMS = {
    "sed": ["sed", "-n", "--", "{summary}", "notes.txt"],           # a summary `1e id > /tmp/x` runs id
    "ssh": ["ssh", "host", "--", "{summary}"],                      # a remote command
    "xdg-open": ["xdg-open", "--", "{object}"],                     # opens whatever the text names
    "find": ["find", "--", "{summary}"],                            # `-delete` is an expression
    "vim": ["vim", "-es", "--", "{summary}"],                       # ex mode
    "tar": ["/usr/bin/tar", "-cf", "a.tar", "--", "{object}"],      # archives any file the text names
}


@pytest.mark.parametrize("run", TRIAL_FORMS.values(), ids=TRIAL_FORMS.keys())
def test_the_trial_forms_are_refused_by_hooks_check_with_the_safe_form(tmp_path, capsys, run):
    path = write_rule(tmp_path, run)
    code = deskeye_main(["--settings", str(tmp_path / "none.toml"), "hooks", "check", "--rules", str(path)])
    err = capsys.readouterr().err
    assert code == 2, "the rule was accepted"
    assert str(path) in err and "'trial'" in err and f"arguments of {run[0]!r}" in err
    assert all(words in err for words in SAFE_FORM_WORDS), err


RENAMED_PYTHONS = {   # id: (name, a copy rather than a symlink, the rest of the rule's argv)
    "symlink to python named mytool": ("mytool", False, ["-c", "import os, sys; os.system(sys.argv[2])", "--",
                                                         "{summary}"]),
    "symlink to python named notify-send": ("notify-send", False, ["DeskEye", "--", "{summary}"]),
    "copy of python named logger": ("logger", True, ["-t", "deskeye", "--", "{summary}"]),
}


@pytest.mark.parametrize("name, copy, rest", RENAMED_PYTHONS.values(), ids=RENAMED_PYTHONS.keys())
def test_an_interpreter_under_another_name_is_refused(tmp_path, name, copy, rest):
    run = [python_under_another_name(tmp_path, name, copy=copy), *rest]
    path = write_rule(tmp_path, run)
    with pytest.raises(HookRuleError) as caught:
        load_rules(path)
    message = str(caught.value)
    assert message.startswith(str(path)) and "'trial'" in message and run[0] in message
    assert all(words in message for words in SAFE_FORM_WORDS), message
    assert deskeye_main(["--settings", str(tmp_path / "none.toml"), "hooks", "check", "--rules", str(path)]) == 2


def test_a_renamed_interpreter_found_first_on_path_is_refused(tmp_path, monkeypatch):
    """The rule names plain `notify-send`, but PATH finds a symlink to python first."""
    fake = python_under_another_name(tmp_path, "notify-send")
    monkeypatch.setenv("PATH", f"{Path(fake).parent}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(HookRuleError, match=r"is really .*not notify-send.*\$DESKEYE_SUMMARY"):
        load_rules(write_rule(tmp_path, ["notify-send", "DeskEye", "--", "{summary}"]))


def test_the_sed_trap_is_real_and_refused(tmp_path):
    """The trial: `sed -n -- {summary} FILE` with the summary `1e touch MARKER` runs `touch` (GNU sed's `e`)."""
    marker = tmp_path / "PWNED"
    notes = tmp_path / "notes.txt"
    notes.write_text("line\n")
    run = ["sed", "-n", "--", "{summary}", str(notes)]
    hostile = Description(f"1e touch {marker}", ["Inbox"])
    # built past the loader's checks, the rule runs the command hidden in the summary
    unchecked = HookRule(name="trial", source="t", keywords=("inbox",), run=tuple(run))
    fire_and_wait(HookRunner([unchecked]), hostile)
    assert marker.exists(), "sed did not run the command: the trap is broken"
    marker.unlink()
    with pytest.raises(HookRuleError, match=r"arguments of 'sed'.*\$DESKEYE_SUMMARY"):
        load_rules(write_rule(tmp_path, run))
    assert not marker.exists()


# ------------------------------------------------------------------ a real hook gets hostile text as data

HOSTILE = ["1e touch {marker}", "$(touch {marker})", "; touch {marker}", "`touch {marker}`", "--help",
           "-e 1e touch {marker}", "-n\n1e touch {marker}\n"]

# The safe form: a script of the user's reads the text from its environment and standard input and hands it on
# as data: here to sed as its input (never its script).
HOOK_SCRIPT = """#!/bin/sh
cat > "$1/stdin.json"
printf '%s' "$DESKEYE_SUMMARY" | sed -n -e p > "$1/summary.txt"
printf '%s' "$DESKEYE_KEY_OBJECTS" > "$1/key_objects.json"
"""


@pytest.mark.parametrize("payload", HOSTILE)
def test_a_real_hook_receives_hostile_text_intact_as_data_and_nothing_else_runs(tmp_path, payload):
    marker = tmp_path / "PWNED"
    payload = payload.replace("{marker}", str(marker))
    script = tmp_path / "hook.sh"
    script.write_text(HOOK_SCRIPT, encoding="utf-8")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    [rule] = load_rules(write_rule(tmp_path, [str(script), str(tmp_path)]))
    key_objects = [f"Inbox {payload}", payload]
    [firing] = fire_and_wait(HookRunner([rule], audit_path=tmp_path / "audit.jsonl"),
                             Description(payload, key_objects))
    assert firing.ok, firing.errors
    assert firing.argv == [str(script), str(tmp_path)]
    assert json.loads((tmp_path / "stdin.json").read_text(encoding="utf-8")) == \
        {"hook": "trial", "summary": payload, "object": f"Inbox {payload}", "key_objects": key_objects}
    assert (tmp_path / "summary.txt").read_text(encoding="utf-8").rstrip("\n") == payload.rstrip("\n")
    assert json.loads((tmp_path / "key_objects.json").read_text(encoding="utf-8")) == key_objects
    assert not marker.exists()


def test_text_no_utf8_can_hold_still_reaches_the_hook(tmp_path):
    """A lone surrogate (possible in JSON model output) becomes U+FFFD instead of failing the command."""
    out = tmp_path / "seen.json"
    script = tmp_path / "hook"
    script.write_text(f"#!{sys.executable}\nimport os, sys\nopen({str(out)!r}, 'wb').write(sys.stdin.buffer.read())\n"
                      f"open({str(out)!r} + '.env', 'w').write(os.environ['DESKEYE_SUMMARY'])\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    [rule] = load_rules(write_rule(tmp_path, [str(script)]))
    [firing] = fire_and_wait(HookRunner([rule]), Description("a\ud800b", ["Inbox\udfff"]))
    assert firing.ok, firing.errors
    assert json.loads(out.read_bytes())["summary"] == "a\ufffdb"
    assert json.loads(out.read_bytes())["object"] == "Inbox\ufffd"
    assert Path(f"{out}.env").read_text() == "a\ufffdb"


# ------------------------------------------------------------------ the allowed programs take text as messages

def test_notify_send_gets_hostile_text_as_the_message_on_a_real_bus(tmp_path, notification_server):
    marker = tmp_path / "PWNED"
    summary = f"--help -u critical $(touch {marker})"
    [rule] = load_rules(write_rule(tmp_path, ["notify-send", "DeskEye", "--", "{summary}"]))
    assert rule.run[0] == os.path.realpath(shutil.which("notify-send"))    # what was checked is what runs
    [firing] = fire_and_wait(HookRunner([rule]), Description(summary, ["Inbox"]))
    assert firing.ok, firing.errors
    [call] = notification_server.wait_for_calls(1)
    assert (call.title, call.body) == ("DeskEye", summary)
    assert not marker.exists()


@pytest.mark.parametrize("text", ["--help", "-f /etc/shadow", "-e 1e id", "$(id)", "--journald"])
def test_logger_takes_every_operand_after_dashes_as_the_message(tmp_path, text):
    """Checks the allow-list entry itself: the system's logger, with the rule's options, prints (no syslog here)
    exactly the text as the message."""
    [rule] = load_rules(write_rule(tmp_path, ["logger", "--no-act", "--stderr", "--socket-errors=off",
                                              "-t", "deskeye", "--", "{summary}"]))
    argv = [part.replace("{summary}", text) for part in rule.run]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    assert done.stderr.rstrip("\n").endswith(f"deskeye: {text}"), done.stderr


# ------------------------------------------------------------------ the default rules keep working

def test_the_default_rules_load_and_fire_with_hostile_text(tmp_path, notification_server):
    rules = load_hook_rules(load_settings(tmp_path / "none.toml"))     # DeskEye's defaults, no user file
    assert {"unread-mail", "error-dialog", "low-battery", "meeting-starting"} <= {r.name for r in rules}
    summary = f"Mail: 3 unread; $(touch {tmp_path / 'PWNED'}) --help"
    firings = fire_and_wait(HookRunner(rules, Notifier(backend="dbus"), language="en"),
                            Description(summary, ["INBOX (3 unread)", "Error dialog: sync failed"]))
    assert sorted(f.hook for f in firings) == ["error-dialog", "unread-mail"]
    assert all(f.ok for f in firings), [f.errors for f in firings]
    calls = notification_server.wait_for_calls(2)
    assert sorted(c.title for c in calls) == ["DeskEye: Error dialog", "DeskEye: Unread mail"]
    assert {c.body for c in calls} == {summary}
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "folder"])
def test_a_hooks_file_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path, kind):
    """`hooks.rules_file` pointing at a FIFO would block the loader forever, /dev/zero would eat memory: both
    are refused from their stat, in a child with a deadline so a regression fails instead of hanging."""
    if kind == "fifo":
        path = tmp_path / "hooks.toml"
        os.mkfifo(path)
    elif kind == "folder":
        path = tmp_path / "hooks.d"
        path.mkdir()
    else:
        path = Path("/dev/zero")
    code = ("import sys\nfrom deskeye.errors import HookRuleError\nfrom deskeye.hooks.rules import load_rules\n"
            "try:\n    load_rules(sys.argv[1])\nexcept HookRuleError as exc:\n    print(exc)\n    sys.exit(2)\n")
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert str(path) in done.stdout and "regular file" in done.stdout
