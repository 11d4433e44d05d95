"""Hooks that mean it: keywords match whole words and whole Chinese terms, the default rules tell an error dialog
(English or Chinese) from notes that mention an error, a cooldown is per rule AND per object, and a notification
shows the rule's readable title in the user's language, as the real notification daemon (dunst) displays it.

Only the API that hooks always had is imported at the top (parse_rules, HookRunner, Description), so on older code
these tests fail on what they check, not on an import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deskeye.errors import HookRuleError
from deskeye.hooks.rules import HookRule, load_rules, parse_rules
from deskeye.hooks.runner import HookRunner
from deskeye.prompt import Description

pytestmark = [pytest.mark.desktop, pytest.mark.subprocess]

REPO = Path(__file__).resolve().parent.parent
DEFAULT_RULES = REPO / "deskeye" / "rules" / "hooks.toml"
NOTES = [   # a text editor with meeting notes that mention an error log: no dialog anywhere
    Description("一个文本编辑器：会议记录", ["会议记录.txt", "错误日志见 server.py:42", "Mousepad"]),
    Description("A text editor with meeting notes", ["Meeting notes", "see error log", "fix failed build"]),
    Description("A terminal", ["Traceback (most recent call last)", "ValueError: bad input"]),
]
DIALOGS = [  # an error dialog as the vision models and the OCR engine describe one, English and Chinese
    (Description("一个对话框：保存失败", ["对话框", "保存失败", "确定"]), "保存失败"),
    (Description("A dialog titled Error", ["Error", "OK"]), "Error"),
    (Description("An error dialog", ["Error dialog", "Could not save report.txt", "OK"]), "Could not save report.txt"),
    (Description("An error dialog “保存失败”: 保存失败 确定", ["error dialog"]), "error dialog"),
    (Description("An alert", ["Couldn’t connect to the server"]), "Couldn’t connect to the server"),
]


class FakeClock:
    def __init__(self):
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


class Recorder:
    """A notifier that keeps what it was asked to show (the real daemon is in the last test)."""

    def __init__(self):
        self.shown: list[tuple[str, str]] = []

    def notify(self, title: str, body: str) -> bool:
        self.shown.append((title, body))
        return True


def one_rule(**table) -> HookRule:
    [rule] = parse_rules({"hook": [{"name": "probe", "notify": True, **table}]}, "test.toml")
    return rule


def fire(runner: HookRunner, description: Description) -> list:
    firings = runner.fire(description)
    for firing in firings:
        assert firing.wait(30), f"hook {firing.hook} did not finish"
    return firings


# ------------------------------------------------------------------ whole words and whole Chinese terms

@pytest.mark.parametrize("keyword, text, found", [
    ("error", "Fatal ERROR: disk", True),
    ("error", "ＥＲＲＯＲ 0x80", True),                  # full width: the same word
    ("error", "terrors of the deep", False),
    ("error", "errorlog.txt", False),
    ("error", "error_log", False),
    ("error", "Error保存", True),                        # a change of script is a boundary
    ("new mail", "New  mail (3)", True),
    ("new mail", "new mailbox", False),
    ("couldn't", "Couldn’t save", True),                 # the typographic apostrophe
    ("échec", "Échec de l'enregistrement", True),        # Unicode letters, not just ASCII
    ("échec", "échecs et mat", False),
    ("ошибка", "Ошибка сохранения", True),
    ("ошибка", "ошибках", False),
])
def test_latin_and_other_spaced_scripts_match_whole_words(keyword, text, found):
    assert (one_rule(match=[keyword]).match([text]) == text) is found


@pytest.mark.parametrize("keyword, text, found", [
    ("失败", "保存失败", True),                # 保存|失败
    ("失败", "文件保存失败了", True),
    ("无法", "无法保存文件", True),
    ("未读", "3 封未读邮件", True),            # 未|读|邮件: a term may span several words
    ("会议", "会议 10:00", True),
    ("会议", "会议室预订", False),             # 会议室, a meeting room
    ("错误", "错误码 0x80", False),            # 错误码, an error code
    ("失败", "失败率 3%", False),              # 失败率, a failure rate
    ("邮件", "垃圾邮件 (12)", False),          # 垃圾邮件, spam
    ("新邮件", "最新邮件", False),             # 最新|邮件: 新 belongs to 最新
    ("电量低", "电池电量低", False),           # 电池电量|低 (the default rule lists 电池电量低 itself)
])
def test_chinese_keywords_match_whole_terms_as_segmented(keyword, text, found):
    assert (one_rule(match=[keyword]).match(["桌面", text]) == text) is found


def test_hostile_text_is_bounded_and_matching_stays_linear():
    """No regex runs on model text: a long run of Han characters and a keyword past the searched part."""
    from deskeye.hooks.terms import MAX_TEXT_CHARS, TermText
    text = "错" * MAX_TEXT_CHARS + "保存失败"
    assert not TermText(text).has("失败")                    # cut at MAX_TEXT_CHARS
    assert TermText("保存失败" + "错" * (MAX_TEXT_CHARS - 10)).has("失败")
    assert TermText("a" * 100_000).has("a") is False         # never a boundary inside a long word


# ------------------------------------------------------------------ the default rules, both languages

@pytest.mark.parametrize("description", NOTES, ids=["zh-notes", "en-notes", "terminal"])
def test_notes_that_mention_an_error_fire_no_default_hook(description):
    runner = HookRunner(load_rules(DEFAULT_RULES), dry_run=True)
    assert fire(runner, description) == []
    runner.close()


@pytest.mark.parametrize("description, message", DIALOGS, ids=["zh", "en-title", "en-message", "ocr", "alert"])
def test_an_error_dialog_fires_the_default_rule_on_its_message(description, message):
    runner = HookRunner(load_rules(DEFAULT_RULES), dry_run=True)
    [firing] = fire(runner, description)
    assert (firing.hook, firing.matched_object) == ("error-dialog", message)
    runner.close()


@pytest.mark.parametrize("description, hook", [
    (Description("邮件客户端", ["收件箱", "3 封未读邮件"]), "unread-mail"),
    (Description("Power", ["Battery low: 7%"]), "low-battery"),
    (Description("系统通知", ["电池电量低，请充电"]), "low-battery"),
    (Description("日历提醒", ["会议即将开始", "加入会议"]), "meeting-starting"),
    (Description("郵件", ["3 封未讀郵件"]), "unread-mail"),                 # traditional Chinese
    (Description("電源", ["電量不足"]), "low-battery"),
    (Description("行事曆", ["會議即將開始"]), "meeting-starting"),
])
def test_the_other_default_rules_fire_in_both_languages(description, hook):
    runner = HookRunner(load_rules(DEFAULT_RULES), dry_run=True)
    assert [f.hook for f in fire(runner, description)] == [hook]
    runner.close()


# ------------------------------------------------------------------ cooldowns per rule and per object

def test_one_objects_cooldown_never_swallows_another():
    """The reported case: a rule fires on notes, and 4 minutes later a real Chinese error dialog still fires."""
    clock = FakeClock()
    runner = HookRunner(parse_rules({"hook": [{"name": "errors", "match": ["error", "错误", "失败"], "notify": True,
                                                "cooldown_s": 300}]}, "t.toml"), Recorder(), clock=clock)
    assert len(fire(runner, Description("notes", ["错误日志见 server.py:42"]))) == 1
    clock.now_s += 240
    assert [f.matched_object for f in fire(runner, Description("a dialog", ["保存失败"]))] == ["保存失败"]
    clock.now_s += 30
    assert fire(runner, Description("notes", ["错误日志见 server.py:42"])) == []   # still cooling down
    clock.now_s += 31
    assert len(fire(runner, Description("notes", ["错误日志见 server.py:42"]))) == 1
    runner.close()


def test_the_same_object_with_other_numbers_or_case_shares_one_cooldown():
    clock = FakeClock()
    runner = HookRunner(load_rules(DEFAULT_RULES), Recorder(), clock=clock)
    assert [f.hook for f in fire(runner, Description("Power", ["Battery low: 15%"]))] == ["low-battery"]
    clock.now_s += 120
    assert fire(runner, Description("Power", ["BATTERY LOW:  14%"])) == []
    assert [f.matched_object for f in fire(runner, Description("电源", ["电量不足"]))] == ["电量不足"]
    clock.now_s += 900
    assert len(fire(runner, Description("Power", ["Battery low: 12%"]))) == 1
    runner.close()


def test_remembered_cooldowns_are_bounded():
    from deskeye.hooks.cooldowns import MAX_ENTRIES, Cooldowns
    clock = FakeClock()
    cooldowns = Cooldowns(clock)
    for number in range(MAX_ENTRIES + 50):
        assert cooldowns.take("r", 60, f"dialog {chr(0x4E00 + number)}")
    assert len(cooldowns) <= MAX_ENTRIES
    assert not cooldowns.take("r", 60, f"dialog {chr(0x4E00 + MAX_ENTRIES + 49)}")   # the newest are kept,
    assert cooldowns.take("r", 60, f"dialog {chr(0x4E00)}")                             # the oldest forgotten


# ------------------------------------------------------------------ readable titles in the user's language

TITLED = {"match": ["inbox"], "title": {"en": "Unread mail", "zh_CN": "未读邮件"}}


@pytest.mark.parametrize("table, language, title", [
    (TITLED, "en", "DeskEye: Unread mail"),
    (TITLED, "zh_CN", "DeskEye: 未读邮件"),
    (TITLED, "zh_TW", "DeskEye: 未读邮件"),                        # no zh_TW: the other Chinese before English
    ({"match": ["inbox"], "title": "Post"}, "zh_CN", "DeskEye: Post"),
    ({"match": ["inbox"]}, "zh_CN", "DeskEye: Probe"),            # no title: the name, readable
])
def test_a_notification_shows_the_rules_readable_title(table, language, title):
    notifier = Recorder()
    runner = HookRunner([one_rule(**table)], notifier, language=language)
    fire(runner, Description("Mail", ["Inbox"]))
    assert notifier.shown == [(title, "Mail")]
    runner.close()


@pytest.mark.parametrize("environ, language", [
    ({"LANG": "zh_CN.UTF-8"}, "zh_CN"), ({"LANG": "zh_TW.UTF-8"}, "zh_TW"), ({"LC_ALL": "zh_HK.UTF-8"}, "zh_TW"),
    ({"LANGUAGE": "zh_CN:en", "LANG": "en_US.UTF-8"}, "zh_CN"), ({"LANG": "de_DE.UTF-8"}, "en"), ({}, "en"),
])
def test_the_users_language_comes_from_the_locale(environ, language):
    from deskeye.language import locale_language
    assert locale_language(environ) == language


@pytest.mark.parametrize("table, reason", [
    ({"match": ["x"], "title": {"fr": "Courrier"}}, "unknown language(s) fr"),
    ({"match": ["x"], "title": ""}, "'title' must be a non-empty string"),
    ({"match": ["x"], "title": "x" * 200}, "a title has at most"),
    ({"match": ["x"], "needs": []}, "'needs' must be a non-empty list"),
    ({"match": ["  "]}, "'match' must be a non-empty list"),
])
def test_bad_titles_and_needs_are_refused_with_the_reason(table, reason):
    with pytest.raises(HookRuleError) as caught:
        one_rule(**table)
    assert reason in str(caught.value) and "'probe'" in str(caught.value)


# ------------------------------------------------------------------ the real notification daemon

@pytest.fixture
def desktop_with_dunst():
    from tests.fixtures.desktop import start_desktop
    desktop = start_desktop(800, 600, tray=None)
    yield desktop
    desktop.stop()


def dunst_history(desktop, env) -> list[dict]:
    done = subprocess.run(["dunstctl", "history"], capture_output=True, text=True, timeout=10, env=env)
    assert done.returncode == 0, done.stderr
    return [{key: value["data"] for key, value in entry.items()} for entry in json.loads(done.stdout)["data"][0]]


@pytest.mark.slow
@pytest.mark.parametrize("lang, title", [("en_US.UTF-8", "DeskEye: Error dialog"),
                                         ("zh_CN.UTF-8", "DeskEye: 错误对话框")])
def test_dunst_shows_the_readable_title_of_a_chinese_error_dialog_and_nothing_for_notes(
        tmp_path, desktop_with_dunst, lang, title):
    """`deskeye hooks fire` as a real process with the default rules, in each locale: the dialog puts up one dunst
    bubble whose title is the rule's readable title in the locale's language; the notes fire nothing."""
    from tests.fixtures.polling import wait_until
    desktop = desktop_with_dunst
    env = {key: value for key, value in desktop.env(LANG=lang, LC_ALL=lang).items()
           if key not in ("LANGUAGE", "LC_MESSAGES")}

    def hooks_fire(description: Description) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "deskeye.cli", "--settings", str(tmp_path / "none.toml"), "hooks", "fire",
             "--summary", description.summary, "--key-objects", json.dumps(description.key_objects)],
            capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert hooks_fire(DIALOGS[0][0]).splitlines() == ['fired error-dialog on "保存失败"']
    assert wait_until(lambda: desktop.xdotool("search", "--onlyvisible", "--class", "Dunst"), 10), "no bubble"
    subprocess.run(["dunstctl", "close-all"], check=True, timeout=10, env=env)
    [shown] = wait_until(lambda: dunst_history(desktop, env), 10)
    assert (shown["appname"], shown["summary"], shown["body"]) == ("DeskEye", title, DIALOGS[0][0].summary)
    assert title in shown["message"]                    # what dunst drew: its format puts the title first
    assert hooks_fire(NOTES[0]).startswith("no hook matched")
    assert len(dunst_history(desktop, env)) == 1
