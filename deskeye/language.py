"""The user's language: the one place that decides it, and DeskEye's own words in it.

`ui.language` (deskeye/settings.py) is "auto", "en", "zh_CN" or "zh_TW". "auto" reads the locale variables gettext
reads (LANGUAGE, LC_ALL, LC_MESSAGES, LANG: the first one set): zh_TW, zh_HK, zh_MO and zh_Hant are traditional
Chinese, any other zh simplified, everything else English. A command resolves the setting once when it starts
(`use_language`, called by deskeye/cli.py); the tray, menus, Ask box, overlay and notices then show their words
through `_()`, and the model is asked to answer in that language (deskeye/prompt.py).

A typed question in Chinese is answered in Chinese whatever the setting (`answer_language`): the user chose the
language by typing it.

UI strings are gettext messages in English; the catalogs are deskeye/locale/<language>/LC_MESSAGES/deskeye.po,
compiled to the .mo files beside them, which are kept in the repository: package data that an editable install
and a built wheel both read, with nothing to compile at install. A string defined at import time is marked
`N_("...")` there and translated where it is shown, `_(CONSTANT)`: the language is known only once the settings are
read. After changing or adding a wrapped string (babel.cfg says what is extracted; Babel is in the dev extra):

    pybabel extract -F babel.cfg --no-location --sort-output -w 120 -o deskeye.pot .
    pybabel update -i deskeye.pot -d deskeye/locale -D deskeye -w 120     # then translate the new entries
    pybabel compile -d deskeye/locale -D deskeye

tests/test_language.py checks every extracted string is translated and the .mo files match the .po files.
"""

from __future__ import annotations

import functools
import gettext
import logging
import os
import re
from typing import Mapping

log = logging.getLogger(__name__)

ENGLISH, SIMPLIFIED_CHINESE, TRADITIONAL_CHINESE = "en", "zh_CN", "zh_TW"
LANGUAGES = (ENGLISH, SIMPLIFIED_CHINESE, TRADITIONAL_CHINESE)     # what DeskEye speaks
AUTO = "auto"
SETTING_VALUES = (AUTO, *LANGUAGES)                                # what `ui.language` accepts
DOMAIN = "deskeye"                                                 # the catalogs' file name: deskeye.mo
LOCALE_VARIABLES = ("LANGUAGE", "LC_ALL", "LC_MESSAGES", "LANG")
_TRADITIONAL_LOCALES = ("zh_tw", "zh_hk", "zh_mo", "zh_hant")

# CJK Unified Ideographs (+ extension A) and CJK symbols/punctuation: one of them makes a text Chinese.
_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\u3000-\u303f]")
# Common characters written only one way in each script (none is in both): how a Chinese question's script is told.
_SIMPLIFIED_ONLY = frozenset("这个们来时说为会对发问题么见还开关应该与学国体点电脑视错误档网页邮设显钟议话请读写图书车东长门"
                             "间无没过进动现实经样让认识号码户额钱单订报数务录气费总结统计给从两边吗账帐处语译钮键标签执运"
                             "启败储删复贴乱释义")
_TRADITIONAL_ONLY = frozenset("這個們來時說為會對發問題麼見還開關應該與學國體點電腦視錯誤檔網頁郵設顯鐘議話請讀寫圖書車東長門"
                              "間無沒過進動現實經樣讓認識號碼戶額錢單訂報數務錄氣費總結統計給從兩邊嗎賬帳處語譯鈕鍵標籤執運"
                              "啟敗儲刪復貼亂釋義")

_language: str | None = None          # set once by use_language(); None = "auto"


def locale_language(environ: Mapping[str, str] = os.environ) -> str:
    """"en", "zh_CN" or "zh_TW" from the locale variables (see the module's docstring)."""
    value = next((environ[key] for key in LOCALE_VARIABLES if environ.get(key)), "")
    first = value.split(":")[0].replace("-", "_").lower()
    if not first.startswith("zh"):
        return ENGLISH
    return TRADITIONAL_CHINESE if first.startswith(_TRADITIONAL_LOCALES) else SIMPLIFIED_CHINESE


def resolve_language(setting: str, environ: Mapping[str, str] = os.environ) -> str:
    """The language a `ui.language` value means here: itself, or for "auto" the locale's."""
    if setting not in SETTING_VALUES:
        raise ValueError(f"ui.language must be one of {' | '.join(SETTING_VALUES)}; got {setting!r}.")
    return locale_language(environ) if setting == AUTO else setting


def use_language(setting: str) -> str:
    """Make `setting` (a `ui.language` value) the language of this process's words; returns what it resolved to."""
    global _language
    _language = resolve_language(setting)
    return _language


def ui_language() -> str:
    """The language DeskEye speaks in this process: the one `use_language` set, else the locale's."""
    return _language or locale_language()


def detect_lang(text: str) -> str:
    """"zh" when the text holds a Chinese character, else "en"."""
    return "zh" if _CJK.search(text) else "en"


def chinese_script(text: str) -> str | None:
    """"zh_TW" or "zh_CN" when the text's characters tell which script it is written in, else None."""
    num_simplified = sum(char in _SIMPLIFIED_ONLY for char in text)
    num_traditional = sum(char in _TRADITIONAL_ONLY for char in text)
    if num_simplified == num_traditional:
        return None
    return TRADITIONAL_CHINESE if num_traditional > num_simplified else SIMPLIFIED_CHINESE


def answer_language(question: str, language: str) -> str:
    """The language to answer `question` in, for a user of `language`: Chinese for a question in Chinese whatever
    the setting (in the question's script, else the user's Chinese, else simplified), else `language`."""
    if detect_lang(question) != "zh":
        return language
    default = language if language in (SIMPLIFIED_CHINESE, TRADITIONAL_CHINESE) else SIMPLIFIED_CHINESE
    return chinese_script(question) or default


@functools.lru_cache(maxsize=None)
def translator(language: str) -> gettext.NullTranslations:
    """The gettext catalog of `language` (one of LANGUAGES): English is the messages themselves. A missing catalog
    (a broken install) is said once in the log, and the words stay English."""
    if language not in LANGUAGES:
        raise ValueError(f"DeskEye speaks {', '.join(LANGUAGES)}; got {language!r}.")
    if language == ENGLISH:
        return gettext.NullTranslations()
    from importlib.resources import files
    catalog = files("deskeye") / "locale" / language / "LC_MESSAGES" / f"{DOMAIN}.mo"
    try:
        with catalog.open("rb") as stream:
            return gettext.GNUTranslations(stream)
    except OSError as exc:
        log.warning("No %s translation of DeskEye's words (%s); they are shown in English. Reinstall DeskEye.",
                    language, exc)
        return gettext.NullTranslations()


def _(message: str) -> str:
    """`message` (English) in the user's language."""
    return translator(ui_language()).gettext(message)


def N_(message: str) -> str:   # noqa: N802 - gettext's name for "mark for extraction, translate later"
    """Marks a message for extraction where it is defined; it is translated where it is shown, with `_()`."""
    return message
