"""Which language a short text is in, as far as DeskEye cares: Chinese ("zh") or not ("en")."""

from __future__ import annotations

import re

# CJK Unified Ideographs (+ extension A) and CJK symbols/punctuation: one of them makes a query Chinese.
_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\u3000-\u303f]")


def detect_lang(text: str) -> str:
    """"zh" when the text holds a Chinese character, else "en"."""
    return "zh" if _CJK.search(text) else "en"
