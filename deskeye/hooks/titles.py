"""A hook's readable title, in the user's language: what its notification says instead of the rule's name.

A rule gives `title = "Unread mail"` (any language), or a small table by the languages DeskEye speaks:
`title = { en = "Error dialog", zh_CN = "错误对话框", zh_TW = "錯誤對話框" }`. The notification uses the user's
language if the table has it, else the other Chinese for a Chinese user, else `en`, else any the table has; with no
title at all, the rule's name made readable ("error-dialog" -> "Error dialog").

The user's language is the one DeskEye speaks (deskeye/language.py: the `ui.language` setting, else the locale).
"""

from __future__ import annotations

from typing import Mapping

from deskeye.language import LANGUAGES, N_, translator

ANY_LANGUAGE = ""                    # the key a plain `title = "..."` is kept under: shown whatever the language
MAX_TITLE_CHARS = 80
#: a hook's notification title; `{title}` is the rule's readable title
NOTIFICATION_TITLE = N_("DeskEye: {title}")
_FALLBACKS = {"en": ("en",), "zh_CN": ("zh_CN", "zh_TW", "en"), "zh_TW": ("zh_TW", "zh_CN", "en")}


def readable_name(name: str) -> str:
    """A rule's name as a title: "error-dialog" -> "Error dialog", "low_battery" -> "Low battery"."""
    words = name.replace("-", " ").replace("_", " ").split()
    text = " ".join(words) or name
    return text[:1].upper() + text[1:]


def title_in(titles: Mapping[str, str], name: str, language: str) -> str:
    """The title to show a user of `language` (one of LANGUAGES) for a rule with these titles and this name."""
    for candidate in _FALLBACKS.get(language, ("en",)):
        if titles.get(candidate):
            return titles[candidate]
    return titles.get(ANY_LANGUAGE) or next(iter(titles.values()), "") or readable_name(name)


def notification_title(title: str, language: str) -> str:
    return translator(language).gettext(NOTIFICATION_TITLE).format(title=title)


def parse_title(value, fail) -> dict[str, str]:
    """The `title` key of a rule: a string (stored as the title for every language) or a table by language."""
    if value is None:
        return {}
    if isinstance(value, str):
        return {ANY_LANGUAGE: _checked_title(value, "title", fail)}
    if not isinstance(value, dict) or not value:
        fail("'title' must be a string, e.g. title = \"Unread mail\", or a table by language, "
             "e.g. title = { en = \"Unread mail\", zh_CN = \"未读邮件\", zh_TW = \"未讀郵件\" }.")
    unknown = sorted(set(value) - set(LANGUAGES))
    if unknown:
        fail(f"'title' has unknown language(s) {', '.join(unknown)}; use {', '.join(LANGUAGES)}.")
    return {language: _checked_title(text, f"title.{language}", fail) for language, text in value.items()}


def _checked_title(text, key: str, fail) -> str:
    if not isinstance(text, str) or not text.strip():
        fail(f"'{key}' must be a non-empty string.")
    if len(text) > MAX_TITLE_CHARS:
        fail(f"'{key}' is {len(text)} characters; a title has at most {MAX_TITLE_CHARS}.")
    return " ".join(text.split())
