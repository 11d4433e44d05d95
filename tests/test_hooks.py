"""Automation hooks: real subprocesses (no shell), cooldowns on an injected clock, hostile model text,
the audit log, bad rule files, notifications on a real D-Bus, and the `deskeye hooks` commands."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from deskeye.cli import main as deskeye_main
from deskeye.errors import HookRuleError
from deskeye.hooks.rules import HookRule, load_rules, parse_rules
from deskeye.hooks.runner import HookRunner
from deskeye.ui.notify import Notifier
from deskeye.prompt import Description

pytestmark = [pytest.mark.desktop, pytest.mark.subprocess]

REPO = Path(__file__).resolve().parent.parent
# A hook script in the safe form, run as [RECORDER, OUT] (model text never in argv): appends
# {"argv": ARGS after OUT, "env": {DESKEYE_*}, "stdin": the JSON document it read} as one JSON line to OUT.
RECORDER_CODE = ("import json, os, sys\n"
                 "env = {k: v for k, v in os.environ.items() if k.startswith('DESKEYE_')}\n"
                 "stdin = json.loads(sys.stdin.buffer.read())\n"
                 "open(sys.argv[1], 'a', encoding='utf-8').write(\n"
                 "    json.dumps({'argv': sys.argv[2:], 'env': env, 'stdin': stdin}) + '\\n')\n")


class FakeClock:
    def __init__(self):
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def write_rules(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hooks.toml"
    path.write_text(text, encoding="utf-8")
    return path


def recorder_script(folder: Path) -> str:
    script = folder / "recorder"
    if not script.exists():
        script.write_text(f"#!{sys.executable}\n{RECORDER_CODE}", encoding="utf-8")
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def recorder_rule(out: Path, name: str = "mail", match: str = '["inbox", "邮件"]', cooldown_s: float = 60) -> str:
    run = json.dumps([recorder_script(out.parent), str(out)])
    return f'[[hook]]\nname = "{name}"\nmatch = {match}\nrun = {run}\ncooldown_s = {cooldown_s}\n'


def recorded(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()] if out.exists() else []


def fire_and_wait(runner: HookRunner, description: Description):
    firings = runner.fire(description)
    for firing in firings:
        assert firing.wait(30), f"hook {firing.hook} did not finish"
    return firings


def test_matching_hook_runs_a_real_subprocess_and_others_do_not(tmp_path, monkeypatch):
    """The hook's DESKEYE_ variables are this firing's alone: none inherited from DeskEye's own environment (a stale
    DESKEYE_OBJECT of a DeskEye started from another one's hook, a setting such as DESKEYE_SKIP_VLLM)."""
    monkeypatch.setenv("DESKEYE_OBJECT", "stale object")
    monkeypatch.setenv("DESKEYE_SKIP_VLLM", "1")
    out = tmp_path / "calls.jsonl"
    rules = load_rules(write_rules(tmp_path, recorder_rule(out)))
    runner = HookRunner(rules, audit_path=tmp_path / "audit.jsonl")
    assert fire_and_wait(runner, Description("A code editor", ["main.py", "Terminal"])) == []
    [firing] = fire_and_wait(runner, Description("Mail client open", ["Toolbar", "INBOX (3 unread)", "Calendar"]))
    assert (firing.hook, firing.matched_object, firing.exit_code, firing.errors) == ("mail", "INBOX (3 unread)", 0, [])
    [call] = recorded(out)
    assert call["argv"] == []
    assert call["stdin"] == {"hook": "mail", "summary": "Mail client open", "object": "INBOX (3 unread)",
                             "key_objects": ["Toolbar", "INBOX (3 unread)", "Calendar"]}
    assert call["env"] == {"DESKEYE_HOOK": "mail", "DESKEYE_SUMMARY": "Mail client open",
                           "DESKEYE_OBJECT": "INBOX (3 unread)",
                           "DESKEYE_KEY_OBJECTS": json.dumps(["Toolbar", "INBOX (3 unread)", "Calendar"])}
    runner.close()


def test_chinese_keyword_and_regex_match_case_insensitively(tmp_path):
    rules = parse_rules({"hook": [
        {"name": "zh", "match": ["邮件"], "notify": True},
        {"name": "err", "regex": r"\berror\b|错误", "notify": True},
    ]}, "test.toml")
    zh, err = rules
    assert zh.match(["桌面", "您有 3 封邮件"]) == "您有 3 封邮件"     # whole terms: 新邮件 is another word (test_hook_words)
    assert zh.match(["desktop"]) is None
    assert err.match(["ok", "Fatal ERROR: disk"]) == "Fatal ERROR: disk"
    assert err.match(["出现错误"]) == "出现错误"
    assert err.match(["terrors of the deep"]) is None


def test_cooldown_uses_the_injected_clock(tmp_path):
    out = tmp_path / "calls.jsonl"
    clock = FakeClock()
    runner = HookRunner(load_rules(write_rules(tmp_path, recorder_rule(out, cooldown_s=60))), clock=clock)
    seen = Description("inbox", ["Inbox"])
    assert len(fire_and_wait(runner, seen)) == 1
    clock.now_s += 59.5
    assert fire_and_wait(runner, seen) == []
    clock.now_s += 1.0
    assert len(fire_and_wait(runner, seen)) == 1
    assert len(recorded(out)) == 2
    runner.close()


HOSTILE = [
    "; rm -rf ~",
    "$(touch {canary})",
    "`touch {canary}`",
    "a\nb; touch {canary}\r\n",
    "it's \"quoted\" 'twice'",
    "| touch {canary} && echo $HOME > {canary}",
    "{object} {summary} {key_objects} {0} %s {summary.__class__}",
    "--help",
    "名字 \u2028 line-separator \t tab",
]


@pytest.mark.parametrize("payload", HOSTILE)
def test_model_text_reaches_the_command_only_as_data_in_env_and_stdin(tmp_path, payload):
    canary = tmp_path / "PWNED"
    payload = payload.replace("{canary}", str(canary))
    out = tmp_path / "calls.jsonl"
    audit = tmp_path / "audit.jsonl"
    runner = HookRunner(load_rules(write_rules(tmp_path, recorder_rule(out, match='["inbox"]'))), audit_path=audit)
    [firing] = fire_and_wait(runner, Description(payload, [f"inbox {payload}", payload]))
    [call] = recorded(out)
    assert call["argv"] == []                                   # nothing of the model text in argv
    assert call["stdin"] == {"hook": "mail", "summary": payload, "object": f"inbox {payload}",
                             "key_objects": [f"inbox {payload}", payload]}
    assert call["env"]["DESKEYE_SUMMARY"] == payload
    assert call["env"]["DESKEYE_OBJECT"] == f"inbox {payload}"
    assert json.loads(call["env"]["DESKEYE_KEY_OBJECTS"]) == [f"inbox {payload}", payload]
    assert not canary.exists()
    [line] = audit.read_text(encoding="ascii").splitlines()   # hostile newlines cannot split the audit line
    entry = json.loads(line)
    assert entry["argv"] == [recorder_script(tmp_path), str(out)]
    assert entry["key_objects"] == [f"inbox {payload}", payload]
    assert (entry["hook"], entry["object"], entry["dry_run"], entry["exit_code"]) == \
        ("mail", f"inbox {payload}", False, 0)
    assert firing.argv == entry["argv"]


def test_dry_run_runs_nothing_and_audits(tmp_path):
    out, audit = tmp_path / "calls.jsonl", tmp_path / "audit.jsonl"
    runner = HookRunner(load_rules(write_rules(tmp_path, recorder_rule(out))), dry_run=True, audit_path=audit)
    [firing] = fire_and_wait(runner, Description("s", ["inbox"]))
    assert firing.dry_run and firing.exit_code is None and not out.exists()
    entry = json.loads(audit.read_text())
    assert (entry["dry_run"], entry["exit_code"]) == (True, None)
    assert entry["argv"] == [recorder_script(tmp_path), str(out)]
    assert (entry["object"], entry["key_objects"]) == ("inbox", ["inbox"])


def test_fire_does_not_wait_for_the_command_and_close_kills_it(tmp_path):
    path = write_rules(tmp_path, f'[[hook]]\nname = "slow"\nmatch = ["x"]\n'
                                 f'run = {json.dumps([sys.executable, "-c", "import time; time.sleep(120)"])}\n')
    runner = HookRunner(load_rules(path), command_timeout_s=60)
    [firing] = runner.fire(Description("", ["x"]))
    assert not firing.is_done          # fire() returned while the command still runs
    runner.close()
    assert firing.wait(10) and firing.exit_code is not None and firing.exit_code < 0


def test_command_past_its_timeout_is_killed_and_reaped(tmp_path):
    path = write_rules(tmp_path, f'[[hook]]\nname = "slow"\nmatch = ["x"]\n'
                                 f'run = {json.dumps([sys.executable, "-c", "import time; time.sleep(120)"])}\n')
    runner = HookRunner(load_rules(path), command_timeout_s=0.3, audit_path=tmp_path / "audit.jsonl")
    [firing] = fire_and_wait(runner, Description("", ["x"]))
    assert firing.timed_out and firing.exit_code < 0 and "killed after 0.3 s" in firing.errors
    assert json.loads((tmp_path / "audit.jsonl").read_text())["timed_out"] is True


def test_missing_program_is_reported_not_raised(tmp_path):
    path = write_rules(tmp_path, '[[hook]]\nname = "gone"\nmatch = ["x"]\n'
                                 'run = ["/nonexistent/deskeye-tool"]\n')
    [firing] = fire_and_wait(HookRunner(load_rules(path)), Description("s", ["x"]))
    assert not firing.ok and "cannot run '/nonexistent/deskeye-tool'" in firing.errors[0]


def test_notify_hook_reaches_the_desktop_bus(tmp_path, notification_server):
    path = write_rules(tmp_path, '[[hook]]\nname = "error-dialog"\nregex = "error"\nnotify = true\n')
    runner = HookRunner(load_rules(path), Notifier(backend="dbus"))
    summary = "A dialog: Error 0x80 <b>$(reboot)</b>"
    [firing] = fire_and_wait(runner, Description(summary, ["Error dialog"]))
    assert firing.ok
    [call] = notification_server.wait_for_calls(1)
    assert (call.title, call.body) == ("DeskEye: Error dialog", summary)   # the name made readable: no title given


BAD_RULES = [
    ('[[hook]]\nname = "a"\nmatch = ["x"]\nnotify = true\nshell = "sh -c"\n', "'a'", "unknown key(s) shell"),
    ('[[hook]]\nname = "a"\nmatch = ["x"]\nrun = "notify-send hi"\n', "'a'",
     "'run' must be a non-empty list of strings"),
    ('[[hook]]\nname = "a"\nmatch = ["x"]\nrun = ["echo", 3]\n', "'a'", "'run' must be a non-empty list of strings"),
    ('[[hook]]\nname = "a"\nregex = "(unclosed"\nnotify = true\n', "'a'", "bad regex '(unclosed'"),
    ('[[hook]]\nname = "a"\nmatch = ["x"]\nopen_url = "file:///etc/passwd"\n', "'a'", "http:// or https://"),
    ('[[hook]]\nname = "a"\nmatch = ["x"]\nopen_url = "javascript:alert(1)"\n', "'a'", "http:// or https://"),
    ('[[hook]]\nname = "a"\nmatch = ["x"]\nopen_url = "https://x.org/?q={summary}"\n', "'a'", "placeholders"),
    ('[[hook]]\nname = "a"\nmatch = ["x"]\nnotify = true\ncooldown_s = -5\n', "'a'", "'cooldown_s' must be a number"),
    ('[[hook]]\nname = "a"\nnotify = true\n', "'a'", "missing 'match'"),
    ('[[hook]]\nname = "a"\nmatch = ["x"]\nregex = "x"\nnotify = true\n', "'a'", "not both"),
    ('[[hook]]\nmatch = ["x"]\nnotify = true\n', "hook #1", "'name' is missing"),
    ('[[hook]]\nname = "ok"\nmatch = ["x"]\nnotify = true\n[[hook]]\nname = "b"\nmatch = ["y"]\n', "hook #2 ('b')",
     "does nothing"),
    ('[[hook]]\nname = "a"\nmatch = ["x"]\nrun = ["{summary}", "x"]\n', "'a'", "cannot contain a placeholder"),
    ('[[hook]]\nname = "a"\nmatch = ["x"]\nkeys = ["ctrl", "rm -rf"]\n', "'a'", "unknown key name"),
    ('[[hook]]\nname = "a"\nmatch = ["x"]\ntext = "{summary}"\n', "'a'", "typed exactly as written"),
    ('[[hook]]\nname = "a"\nmatch = ["x"]\nnotify = "yes"\n', "'a'", "'notify' must be true or false"),
    ('[[hook]]\nname = "a"\nmatch = ["x"]\nnotify = true\n[[hook]]\nname = "a"\nmatch = ["y"]\nnotify = true\n',
     "hook #2 ('a')", "used twice"),
    ('[[hook]\nname = "a"\n', "hooks.toml", "not valid TOML"),
]


@pytest.mark.parametrize("text, rule, reason", BAD_RULES)
def test_bad_hook_file_names_the_file_the_rule_and_the_problem(tmp_path, text, rule, reason):
    path = write_rules(tmp_path, text)
    with pytest.raises(HookRuleError) as caught:
        load_rules(path)
    message = str(caught.value)
    assert message.startswith(str(path)) and rule in message and reason in message


def test_hooks_check_passes_on_the_shipped_rules(tmp_path, capsys):
    code = deskeye_main(["--settings", str(tmp_path / "none.toml"), "hooks", "check",
                         "--rules", str(REPO / "deskeye" / "rules" / "hooks.toml")])
    lines = capsys.readouterr().out.splitlines()
    assert code == 0
    names = [line.split(":")[0].strip() for line in lines[1:]]
    assert lines[0].endswith(f"{len(names)} rule(s) OK") and {"unread-mail", "error-dialog"} <= set(names)


def test_hooks_check_exits_2_with_the_error_on_a_bad_file(tmp_path, capsys):
    path = write_rules(tmp_path, '[[hook]]\nname = "bad"\nregex = "[x"\nnotify = true\n')
    code = deskeye_main(["--settings", str(tmp_path / "none.toml"), "hooks", "check", "--rules", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and str(path) in err and "'bad'" in err and "bad regex" in err


def test_hooks_fire_command_runs_the_matching_hooks_like_the_app(tmp_path):
    """`deskeye hooks fire` as a real process; the browser is a recorder script named by $BROWSER."""
    out, opened, audit = tmp_path / "calls.jsonl", tmp_path / "opened.txt", tmp_path / "audit.jsonl"
    browser = tmp_path / "browser"
    browser.write_text(f"#!{sys.executable}\nimport sys, time\n"
                       f"open({str(opened)!r}, 'w').write(sys.argv[1]); time.sleep(0.5)\n")
    browser.chmod(browser.stat().st_mode | stat.S_IXUSR)
    rules = write_rules(tmp_path, recorder_rule(out) + 'open_url = "https://mail.example.org/inbox"\n'
                        + '[[hook]]\nname = "other"\nmatch = ["printer"]\nnotify = true\n')
    settings = tmp_path / "settings.toml"
    settings.write_text(f'[hooks]\naudit_log = "{audit}"\n')
    summary = "Inbox; see https://evil.example.com $(touch PWNED)"
    env = {**os.environ, "BROWSER": f"{browser} %s", "DBUS_SESSION_BUS_ADDRESS": f"unix:path={tmp_path}/none"}
    done = subprocess.run(
        [sys.executable, "-m", "deskeye.cli", "--settings", str(settings), "hooks", "fire", "--rules", str(rules),
         "--key-objects", json.dumps(["Inbox (2)", "Desk"]), "--summary", summary],
        capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    argv = [recorder_script(tmp_path), str(out)]
    assert done.stdout.splitlines() == [f'fired mail on "Inbox (2)": run {json.dumps(argv)} -> exit 0']
    assert recorded(out)[0]["stdin"] == {"hook": "mail", "summary": summary, "object": "Inbox (2)",
                                         "key_objects": ["Inbox (2)", "Desk"]}
    assert opened.read_text() == "https://mail.example.org/inbox"
    assert json.loads(audit.read_text())["open_url"] == "https://mail.example.org/inbox"
    assert not (tmp_path / "PWNED").exists()


def test_hooks_fire_rejects_key_objects_that_are_not_a_json_list(tmp_path, capsys):
    code = deskeye_main(["--settings", str(tmp_path / "none.toml"), "hooks", "fire", "--rules",
                         str(REPO / "deskeye" / "rules" / "hooks.toml"), "--key-objects", '{"a": 1}'])
    assert code == 2 and "JSON list of strings" in capsys.readouterr().err


def test_pyautogui_is_imported_only_for_hooks_with_keys(tmp_path):
    script = (
        "import sys\n"
        "from deskeye.hooks.rules import load_rules\n"
        "from deskeye.hooks.runner import HookRunner\n"
        "from deskeye.prompt import Description\n"
        f"runner = HookRunner(load_rules({str(write_rules(tmp_path, recorder_rule(tmp_path / 'o.jsonl')))!r}))\n"
        "[f] = runner.fire(Description('s', ['inbox']))\n"
        "f.wait(30)\n"
        "print('pyautogui' in sys.modules, f.exit_code)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if k != "DISPLAY"})
    assert done.stdout.split() == ["False", "0"], done.stderr


def test_keys_without_a_display_are_reported_not_raised(tmp_path, monkeypatch):
    monkeypatch.delenv("DISPLAY", raising=False)
    path = write_rules(tmp_path, '[[hook]]\nname = "k"\nmatch = ["x"]\nkeys = ["ctrl", "shift", "m"]\n')
    [firing] = fire_and_wait(HookRunner(load_rules(path)), Description("s", ["x"]))
    assert not firing.ok and "DISPLAY is not set" in firing.errors[0]


KEY_WINDOW = r"""
import json, sys, threading, tkinter as tk
root = tk.Tk()
root.geometry("400x80+50+50")
entry = tk.Entry(root)
entry.pack(fill="both", expand=True)
combos = []
root.bind_all("<Control-Key>", lambda e: combos.append([e.keysym.lower(), bool(e.state & 0x1)]))

def answer(line):
    print(json.dumps({"combos": combos, "text": entry.get()}), flush=True)

def read_stdin():
    for line in sys.stdin:
        root.after(0, answer, line)
    root.after(0, root.destroy)

def ready():
    root.focus_force()
    entry.focus_set()
    root.update()
    print("ready", flush=True)

threading.Thread(target=read_stdin, daemon=True).start()
root.after(100, ready)
root.mainloop()
"""


def test_keys_and_text_are_pressed_on_a_real_display(tmp_path, xdisplay):
    """pyautogui (imported only now) presses the rule's combination and types its text into a Tk window."""
    window = subprocess.Popen([sys.executable, "-c", KEY_WINDOW], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=xdisplay.env())
    try:
        assert window.stdout.readline().strip() == "ready"
        path = write_rules(tmp_path, '[[hook]]\nname = "k"\nmatch = ["x"]\nkeys = ["ctrl", "shift", "m"]\n'
                                     'text = "hello deskeye"\n')
        [firing] = fire_and_wait(HookRunner(load_rules(path)), Description("$(touch PWNED)", ["x"]))
        assert firing.ok, firing.errors
        window.stdin.write("dump\n")
        window.stdin.flush()
        seen = json.loads(window.stdout.readline())
    finally:
        window.stdin.close()
        window.wait(10)
    assert ["m", True] in seen["combos"] and seen["text"] == "hello deskeye"


# ------------------------------------------------------------------ model text never steers a program

def tar_rule(archive: Path, member: Path, *, end_of_options: bool) -> dict:
    run = ["tar", "-cf", str(archive), *(["--"] if end_of_options else []), "{object}", str(member)]
    return {"name": "archive", "match": ["compress"], "run": run}


def test_an_option_in_model_text_never_reaches_tar(tmp_path):
    """The attack: a key object `--use-compress-program=...` made `tar ... {object}` run a program."""
    canary = tmp_path / "PWNED"
    member = tmp_path / "notes.txt"
    member.write_text("notes")
    hostile = Description("s", [f"--use-compress-program=touch {canary}"])
    # the trap is real: the rule without '--', built past the loader's checks, makes tar run the program
    unsafe = tar_rule(tmp_path / "a.tar", member, end_of_options=False)
    unchecked = HookRule(name=unsafe["name"], source="t", keywords=tuple(unsafe["match"]), run=tuple(unsafe["run"]))
    fire_and_wait(HookRunner([unchecked], command_timeout_s=20), hostile)
    assert canary.exists(), "tar did not run the compress program: the trap is broken"
    canary.unlink()

    with pytest.raises(HookRuleError, match="before '--'"):
        parse_rules({"hook": [unsafe]}, "t")
    # after '--' tar still reads model text as a file to archive: refused too, naming the safe form
    with pytest.raises(HookRuleError, match=r"allowed only for logger and notify-send.*\$DESKEYE_SUMMARY"):
        parse_rules({"hook": [tar_rule(tmp_path / "b.tar", member, end_of_options=True)]}, "t")
    assert not canary.exists()


CODE_RUNNER_RULES = [
    ["sh", "-c", "echo {summary}"],
    ["/bin/bash", "-c", "notify-send -- \"$1\"", "bash", "--", "{summary}"],
    ["python3", "-c", "print('{summary}')"],
    ["/usr/bin/python3.11", "-c", "import sys; print(sys.argv)", "--", "{object}"],
    ["env", "sh", "-c", "echo {summary}"],
    ["env", "FOO=1", "notify-send", "--", "{summary}"],
    ["xargs", "-0", "--", "{summary}"],
    ["node", "-e", "console.log('{summary}')"],
    ["perl", "-e", "print '{object}'"],
    ["PowerShell.exe", "-Command", "{summary}"],
]


@pytest.mark.parametrize("run", CODE_RUNNER_RULES, ids=lambda run: " ".join(run[:2]))
def test_a_shell_or_interpreter_with_placeholders_is_refused_when_the_rules_load(tmp_path, run):
    path = write_rules(tmp_path, f'[[hook]]\nname = "code"\nmatch = ["x"]\nrun = {json.dumps(run)}\n')
    with pytest.raises(HookRuleError) as caught:
        load_rules(path)
    assert "runs its arguments as code" in str(caught.value) and "'code'" in str(caught.value)


def test_a_shell_without_placeholders_and_a_plain_program_after_dashes_load(tmp_path):
    rules = parse_rules({"hook": [
        {"name": "fixed", "match": ["x"], "run": ["sh", "-c", "notify-send DeskEye 'mail arrived'"]},
        {"name": "plain", "match": ["x"], "run": ["notify-send", "DeskEye", "--", "{summary}", "{object}"]},
    ]}, "t")
    assert [r.name for r in rules] == ["fixed", "plain"]


@pytest.mark.parametrize("run", [["notify-send", "{summary}"], ["notify-send", "--title={summary}", "--", "x"],
                                 ["prog", "-{object}", "--"], ["prog", "--", "x", "--{summary}"]])
def test_a_placeholder_that_could_be_read_as_an_option_is_refused(run):
    with pytest.raises(HookRuleError, match="before '--'"):
        parse_rules({"hook": [{"name": "opt", "match": ["x"], "run": run}]}, "t")


def test_a_catastrophic_regex_does_not_block(tmp_path):
    [rule] = parse_rules({"hook": [{"name": "redos", "regex": "^(a+)+$", "notify": True}]}, "t")
    result: list = []
    worker = threading.Thread(target=lambda: result.append(rule.match(["a" * 5000 + "!", "a" * 40 + "b"])),
                              daemon=True)
    worker.start()
    worker.join(10)                      # a backtracking engine takes ~2**5000 steps here
    assert result == [None], "the rule regex did not finish"
    assert rule.match(["AAAA"]) == "AAAA"                 # still case-insensitive


def test_a_regex_a_linear_engine_cannot_run_is_refused():
    with pytest.raises(HookRuleError, match="RE2"):
        parse_rules({"hook": [{"name": "look", "regex": "(?<=a)b", "notify": True}]}, "t")
