"""One language setting (`ui.language` = auto | en | zh_CN | zh_TW; auto = the locale): DeskEye's own words and the
language the model is asked to answer in.

- On a real desktop (Xvfb, openbox, xfce4-panel's StatusNotifierItem host), `deskeye run` under en_US and zh_CN
  locales and with ui.language = zh_TW: the tray menu read over D-Bus as the panel reads it (com.canonical.dbusmenu),
  the icon's title, the Ask box's title, the pause notice naming the hotkey as "Ctrl+Alt+P" (read from the screen),
  and the describe request the app sends its model server (a recording OpenAI-compatible server, tests/fixtures/
  openai_recorder.py: it answers the same whatever it is asked, so only what the app sends is checked).
- The one-shot commands, as real processes: the describe question and the system prompt in the user's language, and a
  question typed in Chinese asked for a Chinese answer whatever the setting.
- The catalogs: every string the app wraps is translated in both Chinese catalogs, and the compiled .mo files are
  those of the .po files (a built wheel carrying them: tests/test_package_data.py).
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from deskeye import language
from deskeye.hotkey_syntax import display_name
from deskeye.prompt import ANSWER_LANGUAGE_NAMES, describe_question
from deskeye.settings import settings_from_dict
from tests.fixtures.deskeye_process import REPO_ROOT, start_deskeye
from tests.fixtures.desktop import start_desktop
from tests.fixtures.openai_recorder import RecordingServer
from tests.fixtures.polling import wait_until
from tests.fixtures.text_image import render_text_png

pytestmark = [pytest.mark.desktop, pytest.mark.subprocess]

#: the tray menu (deskeye/ui/menu.py), the icon's title when idle, the Ask box's title and the word for Resume
WORDS = {
    "en": (["Describe now", "Ask…", "Pause", "Open settings", "Quit"], "DeskEye (idle)", "Ask DeskEye", "Resume"),
    "zh_CN": (["立即描述", "提问…", "暂停", "打开设置", "退出"], "DeskEye (空闲)", "DeskEye 提问", "继续"),
    "zh_TW": (["立即描述", "提問…", "暫停", "開啟設定", "結束"], "DeskEye (閒置)", "DeskEye 提問", "繼續"),
}
#: (LANG, ui.language, the language DeskEye must speak)
CASES = [("en_US.UTF-8", "auto", "en"), ("zh_CN.UTF-8", "auto", "zh_CN"), ("en_US.UTF-8", "zh_TW", "zh_TW")]
LOCALE_DIR = REPO_ROOT / "deskeye" / "locale"


def locale_env(lang: str) -> dict[str, str]:
    """A locale where LANG decides: the variables that would win over it are emptied (empty = unset for gettext)."""
    return {"LANG": lang, "LANGUAGE": "", "LC_ALL": "", "LC_MESSAGES": ""}


def settings_toml(server: RecordingServer, ui_language: str) -> str:
    return (f'[worker]\nurl = "{server.url}"\napi_key = "test"\nremote_model = "recorder"\nocr_first = false\n'
            f'[overlay]\nfade_after_s = 0.0\n[hooks]\ndry_run = true\n[ui]\nlanguage = "{ui_language}"\n')


def asked(body: dict) -> tuple[str, str]:
    """A chat request's system prompt and the text of its last user message."""
    system = next(m["content"] for m in body["messages"] if m["role"] == "system")
    content = body["messages"][-1]["content"]
    text = content if isinstance(content, str) else " ".join(p["text"] for p in content if p["type"] == "text")
    return system, text


def asks_for(system: str) -> list[str]:
    """The languages a system prompt asks the answer to be written in."""
    return [code for code, name in ANSWER_LANGUAGE_NAMES.items() if f" in {name}," in system]


# ------------------------------------------------------------------ the setting and the hotkey names

@pytest.mark.parametrize("setting, environ, expected", [
    ("auto", {"LANG": "zh_CN.UTF-8"}, "zh_CN"), ("auto", {"LANG": "zh_TW.UTF-8"}, "zh_TW"),
    ("auto", {"LC_ALL": "zh_HK.UTF-8", "LANG": "en_US.UTF-8"}, "zh_TW"), ("auto", {"LANG": "en_US.UTF-8"}, "en"),
    ("auto", {"LANG": "C.UTF-8"}, "en"), ("en", {"LANG": "zh_CN.UTF-8"}, "en"), ("zh_TW", {"LANG": "C"}, "zh_TW"),
])
def test_the_language_is_the_setting_or_for_auto_the_locale(setting, environ, expected):
    assert language.resolve_language(setting, environ) == expected
    assert settings_from_dict({"ui": {"language": setting}}).ui.language == setting


def test_an_unknown_language_setting_is_refused_naming_the_choices():
    from deskeye.errors import SettingsError
    with pytest.raises(SettingsError, match=r"ui\.language.*'fr'.*auto \| en \| zh_CN \| zh_TW"):
        settings_from_dict({"ui": {"language": "fr"}})


@pytest.mark.parametrize("hotkey, shown", [
    ("<ctrl>+<alt>+p", "Ctrl+Alt+P"), ("<CTRL>+<shift>+<page_up>", "Ctrl+Shift+Page Up"), ("<cmd>+<f12>", "Super+F12"),
    ("<ctrl>++", "Ctrl+Plus"), ("<alt_gr>+<65>", "AltGr+Key 65"),
])
def test_hotkeys_are_named_as_keyboards_name_them(hotkey, shown):
    assert display_name(hotkey) == shown


# ------------------------------------------------------------------ on a real desktop

@pytest.fixture(scope="module")
def desktop():
    session = start_desktop(1600, 900, tray="xfce4-panel")
    yield session
    session.stop()


def sni_menu(desktop) -> tuple[str, list[str]] | None:
    """DeskEye's StatusNotifierItem as the panel reads it over D-Bus: its title and its menu's labels (None until it
    is registered)."""
    from jeepney import DBusAddress, Properties, new_method_call
    from jeepney.io.blocking import open_dbus_connection
    from jeepney.wrappers import unwrap_msg
    with open_dbus_connection(bus=desktop.bus_address) as bus:
        watcher = DBusAddress("/StatusNotifierWatcher", bus_name="org.kde.StatusNotifierWatcher",
                              interface="org.kde.StatusNotifierWatcher")
        items = unwrap_msg(bus.send_and_get_reply(Properties(watcher).get("RegisteredStatusNotifierItems")))[0][1]
        item = next((i for i in items if i.endswith("/deskeye")), None)     # ":1.7/org/ayatana/NotificationItem/deskeye"
        if item is None:
            return None
        name, path = item[:item.index("/")], item[item.index("/"):]
        sni = DBusAddress(path, bus_name=name, interface="org.kde.StatusNotifierItem")
        title = unwrap_msg(bus.send_and_get_reply(Properties(sni).get("Title")))[0][1]
        menu = DBusAddress(unwrap_msg(bus.send_and_get_reply(Properties(sni).get("Menu")))[0][1], bus_name=name,
                           interface="com.canonical.dbusmenu")
        _revision, (_id, _props, children) = unwrap_msg(bus.send_and_get_reply(
            new_method_call(menu, "GetLayout", "iias", (0, -1, ["label"]))))
    return title, [child[1][1]["label"][1] for child in children]


def read_back(ocr_text: str) -> str:
    """Text read from the screen, for a loose comparison: no spaces, lower case, the OCR's "I" for "l" undone
    ("Ctrl+AIt+P"). The pynput form "<ctrl>+<alt>+p" never compares equal to "ctrl+alt+p"."""
    return re.sub(r"\s", "", ocr_text).lower().replace("i", "l")


@pytest.mark.slow
@pytest.mark.parametrize("lang, setting, speaks", CASES)
def test_the_tray_ask_box_notices_and_describe_request_speak_the_users_language(desktop, lang, setting, speaks):
    labels, title, ask_title, resume = WORDS[speaks]
    with RecordingServer() as server:
        app = start_deskeye(desktop, settings=settings_toml(server, setting), **locale_env(lang))
        try:
            assert app.read_until("deskeye: watching", 90), "".join(app.output)
            assert wait_until(lambda: sni_menu(desktop), 30) == (title, labels)

            describe = server.wait_for_request(lambda body: True, 60)         # the first screen is described
            assert describe, "the app sent no describe request"
            system, question = asked(describe)
            assert question == describe_question(speaks) and asks_for(system) == [speaks], system

            desktop.xdotool("key", "ctrl+alt+a")
            assert wait_until(lambda: desktop.xdotool("getwindowfocus", "getwindowname") == ask_title, 15), \
                desktop.xdotool("getwindowfocus", "getwindowname")
            desktop.xdotool("key", "Escape")

            desktop.xdotool("key", "ctrl+alt+p")                              # pause: the notice names the hotkey
            assert wait_until(lambda: (sni_menu(desktop) or ("", []))[1][2:3] == [resume], 15), sni_menu(desktop)
            assert wait_until(lambda: "ctrl+alt+p" in read_back(app.overlay_text()), 30), app.overlay_text()
        finally:
            app.stop()


# ------------------------------------------------------------------ the one-shot commands

def subprocess_env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT), "XDG_CACHE_HOME": str(tmp_path / "cache"),
            "XDG_CONFIG_HOME": str(tmp_path / "config"), "XDG_STATE_HOME": str(tmp_path / "state")}


@pytest.mark.slow
@pytest.mark.parametrize("command, lang, setting, speaks", [
    (["describe"], "zh_CN.UTF-8", "auto", "zh_CN"),
    (["describe"], "en_US.UTF-8", "zh_TW", "zh_TW"),
    (["describe"], "en_US.UTF-8", "auto", "en"),
    (["ask", "这个错误是什么意思？"], "en_US.UTF-8", "en", "zh_CN"),           # typed in Chinese: answered in Chinese
    (["ask", "這個錯誤是什麼意思？"], "en_US.UTF-8", "en", "zh_TW"),           # ... in the script it was typed in
    (["ask", "What does this error mean?"], "zh_CN.UTF-8", "auto", "zh_CN"),  # otherwise the user's language
])
def test_one_shot_commands_ask_the_model_for_the_users_language(tmp_path, command, lang, setting, speaks):
    image = tmp_path / "screen.png"
    image.write_bytes(render_text_png(["Build failed: error E1234 in server.py"]))
    settings = tmp_path / "settings.toml"
    with RecordingServer() as server:
        settings.write_text(settings_toml(server, setting), encoding="utf-8")
        env = {**subprocess_env(tmp_path), **locale_env(lang)}
        done = subprocess.run([sys.executable, "-m", "deskeye.cli", "--settings", str(settings), *command,
                               "--image", str(image), "--json"], env=env, cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["summary"] == "A test screen"
        (body,) = server.requests
    system, question = asked(body)
    assert asks_for(system) == [speaks], system
    assert question == (describe_question(speaks) if command == ["describe"] else command[1])


@pytest.mark.slow
def test_a_describe_in_any_language_gets_the_ocr_engines_plain_description(tmp_path):
    """The describe question in Chinese must not become a topic the OCR engine quotes back ("About “屏幕”: ..."):
    each language gets the same lines quoted as read, framed in that language. The app's own request
    (build_messages) to a real OCR worker, in each language."""
    from deskeye.prompt import build_messages, deskeye_response_format
    from tests.fixtures.worker import running_worker
    png = render_text_png(["Build failed: error E1234", "in server.py line 42"])
    with running_worker(["--engine", "ocr"], tmp_path) as worker:
        client = worker.openai_client(timeout=120)
        summaries = {speaks: json.loads(client.chat.completions.create(
            model=worker.model, response_format=deskeye_response_format(),
            messages=build_messages(describe_question(speaks), png, language=speaks)).choices[0].message.content)
            ["summary"] for speaks in WORDS}
    quotes = {tuple(q.split("”")[0] for q in s.split("“")[1:]) for s in summaries.values()}
    assert len(quotes) == 1 and "E1234" in summaries["en"], summaries          # the same lines, quoted as read
    assert not any(s.startswith(("About", "关于", "關於")) for s in summaries.values()), summaries
    assert summaries["zh_CN"] != summaries["en"], summaries                     # framed in the user's language


# ------------------------------------------------------------------ the catalogs

def extracted_messages() -> set[str]:
    """What `pybabel extract -F babel.cfg` finds in the source: every string the app wraps."""
    from babel.messages.frontend import parse_mapping_cfg
    from babel.messages.extract import extract_from_dir
    with open(REPO_ROOT / "babel.cfg", encoding="utf-8") as config:
        method_map, options_map = parse_mapping_cfg(config)
    return {message for _file, _line, message, _comments, _context in
            extract_from_dir(str(REPO_ROOT), method_map, options_map)}


@pytest.mark.parametrize("locale", ["zh_CN", "zh_TW"])
def test_every_wrapped_string_is_translated_and_the_compiled_catalog_is_current(locale):
    from babel.messages.mofile import write_mo
    from babel.messages.pofile import read_po
    po_path = LOCALE_DIR / locale / "LC_MESSAGES" / "deskeye.po"
    with po_path.open("rb") as stream:
        catalog = read_po(stream)
    wrapped = extracted_messages()
    assert len(wrapped) >= 20 and {"Quit", "Ask DeskEye", "thinking…"} <= wrapped
    untranslated = sorted(m for m in wrapped if not (catalog.get(m) and catalog.get(m).string))
    assert not untranslated, f"{po_path}: translate these (pybabel update, see deskeye/language.py): {untranslated}"
    for message in wrapped:                     # placeholders survive translation, so .format() cannot fail
        assert set(re.findall(r"\{\w+\}", catalog.get(message).string)) == set(re.findall(r"\{\w+\}", message))
    compiled = io.BytesIO()
    write_mo(compiled, catalog)
    assert (po_path.with_suffix(".mo")).read_bytes() == compiled.getvalue(), \
        f"{po_path.with_suffix('.mo')} is older than its .po: run pybabel compile -d deskeye/locale -D deskeye"
    assert language.translator(locale).gettext("Quit") == catalog.get("Quit").string


@pytest.mark.parametrize("setting, not_looking, unknown", [("en", "DeskEye is not looking", "Privacy: window titles"),
                                                            ("zh_CN", "DeskEye 没有查看屏幕", "隐私："),
                                                            ("zh_TW", "DeskEye 沒有查看螢幕", "隱私：")])
def test_privacy_refusals_and_the_wayland_titles_notice_speak_the_users_language(setting, not_looking, unknown):
    """What privacy says is read by the person it protects: in their language, with the window's own title and the
    exclusion entry quoted as they are (never translated)."""
    from deskeye.see.privacy import WHERE_REGION, PrivacyVerdict
    from deskeye.see.window_list import SessionWindows

    before = language.ui_language()
    language.use_language(setting)
    try:
        reason = PrivacyVerdict(True, "新标签页 — Mozilla Firefox 隐私浏览", matched="隐私浏览", where=WHERE_REGION).reason
        notice = SessionWindows(environ={"WAYLAND_DISPLAY": "wayland-9", "XDG_SESSION_TYPE": "wayland",
                                         "XDG_CURRENT_DESKTOP": "GNOME"}).titles_unknown_notice(["Private Browsing"])
    finally:
        language.use_language(before)
    assert reason.startswith(not_looking) and "'新标签页 — Mozilla Firefox 隐私浏览'" in reason and "'隐私浏览'" in reason
    assert notice.startswith(unknown) and "(GNOME)" in notice.replace("（", "(").replace("）", ")")
    assert "'Private Browsing'" in notice, notice
