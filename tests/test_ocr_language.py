"""The OCR engine writes in the user's language: a real `deskeye-worker --engine ocr` reading screens rendered with
real fonts (DejaVu, Noto CJK) frames its answers in the request's `deskeye.language` (else the question's), never
quotes the question's own words ("意思", "meaning") as topics, refuses a language it does not speak, and the app
(`deskeye ask`, a real subprocess) sends the user's language.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deskeye.language import _SIMPLIFIED_ONLY, _TRADITIONAL_ONLY
from deskeye.prompt import build_messages, describe_question, deskeye_response_format
from inference_worker.engines.ocr import wording
from inference_worker.engines.ocr.engine import question_words
from inference_worker.engines.ocr.wording import KIND_NAMES, WORDINGS
from tests.fixtures import text_image
from tests.fixtures.text_image import render_text_png
from tests.fixtures.worker import running_worker

pytestmark = [pytest.mark.desktop, pytest.mark.subprocess]

CJK_FONT = "/usr/share/fonts/opentype/noto/NotoSansCJK-Regular.ttc"
ERROR_SCREEN = ["错误: 保存失败", "文件 report.txt 无法写入磁盘"]
ENGLISH_SCREEN = ["Quarterly budget review", "Meeting at 3pm in room 4", "Total 22,000 dollars"]


@pytest.fixture
def render_cjk_png(monkeypatch):
    """render_text_png with Noto Sans CJK (from fonts-noto-cjk), which also draws Chinese."""
    if not Path(CJK_FONT).is_file():
        pytest.fail(f"{CJK_FONT} missing: install fonts-noto-cjk (scripts/test.sh does)")
    monkeypatch.setattr(text_image, "FONT_PATHS", (CJK_FONT,))
    return text_image.render_text_png


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    with running_worker(["--engine", "ocr"], tmp_path_factory.mktemp("ocr_language")) as handle:
        yield handle


def ask(worker, question: str, png: bytes, deskeye: dict | None) -> tuple[int, dict]:
    body = {"model": worker.model, "messages": build_messages(question, png), "temperature": 0,
            "response_format": deskeye_response_format(), **({"deskeye": deskeye} if deskeye is not None else {})}
    return worker.request("POST", "/v1/chat/completions", body, timeout_s=120)


def summary_of(worker, question: str, png: bytes, deskeye: dict | None = None) -> str:
    status, body = ask(worker, question, png, deskeye)
    assert status == 200, body
    return json.loads(body["choices"][0]["message"]["content"])["summary"]


def kind_of(english_summary: str) -> str:
    """The kind an English describe names its screen by: the longest known kind that starts the summary."""
    kinds = [kind for kind in KIND_NAMES if english_summary.startswith(kind)]
    assert kinds, f"the summary starts with no kind the wording table knows: {english_summary!r}"
    return max(kinds, key=len)


def quotes_of(summary: str) -> list[str]:
    return [piece.split("”")[0] for piece in summary.split("“")[1:]]


@pytest.mark.slow
def test_a_describe_is_framed_in_the_requests_language(worker):
    """The describe question is English, so only the `deskeye.language` field can make the answer Chinese."""
    png = render_text_png(ENGLISH_SCREEN)
    question = describe_question("en")
    english = summary_of(worker, question, png, {"language": "en"})
    kind = kind_of(english)
    assert english.startswith(f"{kind}: “"), english
    for language, name in (("zh_CN", KIND_NAMES[kind][0]), ("zh_TW", KIND_NAMES[kind][1])):
        summary = summary_of(worker, question, png, {"language": language})
        assert summary.startswith(f"{name}：“"), (language, summary)
        assert quotes_of(summary) == quotes_of(english), "the screen's text is quoted as read, in any language"
        assert len(summary) <= len(english)
    assert summary_of(worker, question, png) == english, "without the field an English question gets English"


@pytest.mark.slow
def test_windows_behind_are_framed_in_the_language_and_quoted_text_is_never_translated(worker):
    """Window facts (as the app sends them): the window behind gets the language's lead; a line on screen that
    reads like the engine's own framing ("A terminal: ...") is quoted as read."""
    png = render_text_png(["Save failed", "Could not write the file", "A terminal: ls", "Quarterly budget review"])
    windows = [{"title": "Error", "app": "zenity Zenity", "box": [0, 0, 900, 200], "focused": True},
               {"title": "Notes", "app": "mousepad Mousepad", "box": [0, 200, 900, 400]}]
    english = summary_of(worker, describe_question("en"), png, {"language": "en", "windows": windows})
    assert ". Behind it, " in english and "“A terminal: " in english, english
    front, behind = kind_of(english), english.split(". Behind it, ", 1)[1].split(" “", 1)[0]
    behind = next(kind for kind in KIND_NAMES if kind[0].lower() + kind[1:] == behind)
    summary = summary_of(worker, describe_question("en"), png, {"language": "zh_TW", "windows": windows})
    assert summary.startswith(f"{KIND_NAMES[front][1]}“Error”：“"), summary
    assert f"。後面是{KIND_NAMES[behind][1]}“Notes”：“" in summary, summary
    assert quotes_of(summary) == quotes_of(english) and "Behind" not in summary


@pytest.mark.slow
def test_a_chinese_question_is_answered_in_chinese_about_its_topic_not_its_question_words(worker, render_cjk_png):
    png = render_cjk_png(ERROR_SCREEN)
    summary = summary_of(worker, "这个错误是什么意思？", png)
    assert summary.startswith("关于“错误”：“错误"), summary
    assert "意思" not in summary and "About" not in summary, summary
    assert "保存失败" in summary
    traditional = summary_of(worker, "這個錯誤是什麼意思？", png)
    assert traditional.startswith("關於“錯誤”：") or traditional.startswith("螢幕上沒有提到“錯誤”。"), traditional
    assert "意思" not in traditional, traditional


@pytest.mark.slow
def test_an_english_question_word_is_not_a_topic(worker):
    png = render_text_png(ENGLISH_SCREEN)
    summary = summary_of(worker, "What does the meeting line mean? Explain it.", png, {"language": "en"})
    assert summary.startswith("About “meeting”: “Meeting at 3pm"), summary
    assert "“mean" not in summary and "“explain" not in summary


@pytest.mark.slow
def test_nothing_mentioned_names_the_kind_in_the_language(worker):
    png = render_text_png(ENGLISH_SCREEN)
    english = summary_of(worker, "Where is the invoice?", png, {"language": "en"})
    assert english.startswith("Nothing on screen mentions “invoice”. "), english
    kind = english.split(". ", 1)[1].split(":", 1)[0]
    summary = summary_of(worker, "Where is the invoice?", png, {"language": "zh_CN"})
    assert summary.startswith(f"屏幕上没有提到“invoice”。{KIND_NAMES[kind][0]}：“"), summary


@pytest.mark.slow
@pytest.mark.parametrize("value", ["fr", "zh", "ZH_CN", 7, ["en"]])
def test_a_language_the_worker_does_not_speak_is_a_400_naming_the_field(worker, value):
    status, body = ask(worker, "What is this?", render_text_png(["Hello"]), {"language": value})
    assert status == 400, body
    assert body["error"]["param"] == "deskeye.language", body
    assert "en, zh_CN, zh_TW" in body["error"]["message"], body


@pytest.mark.slow
def test_deskeye_ask_sends_the_users_language(tmp_path):
    """`deskeye ask` (the app's client, a real supervised OCR worker) under ui.language = zh_CN: an English question
    gets the Chinese framing the app's language asks for."""
    settings = tmp_path / "settings.toml"
    settings.write_text('[ui]\nlanguage = "zh_CN"\n\n[worker]\nstartup_timeout_s = 60.0\nrequest_timeout_s = 60.0\n',
                        encoding="utf-8")
    image = tmp_path / "screen.png"
    image.write_bytes(render_text_png(ENGLISH_SCREEN))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "DESKEYE_")) and k != "DISPLAY"}
    for name in ("XDG_CONFIG_HOME", "XDG_RUNTIME_DIR", "XDG_CACHE_HOME", "XDG_DATA_HOME"):
        (tmp_path / name).mkdir(mode=0o700)
        env[name] = str(tmp_path / name)
    env.update(HF_HUB_OFFLINE="1", LANG="en_US.UTF-8", LC_ALL="en_US.UTF-8")
    proc = subprocess.run([sys.executable, "-m", "deskeye.cli", "--settings", str(settings), "ask", "--json",
                           "What does the meeting line say?", "--image", str(image)],
                          capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)["summary"]
    assert summary.startswith("关于“meeting”：“Meeting at 3pm"), summary


@pytest.mark.slow
def test_every_kind_the_engine_names_has_both_chinese_names():
    from inference_worker.engines.ocr.layout import KINDS
    from inference_worker.engines.ocr.vocabulary import VOCABULARY

    named = {kind.screen for kind in KINDS.values()} | {c.screen for c in VOCABULARY if c.screen}
    missing = sorted(named - set(KIND_NAMES))
    assert not missing, f"kinds with no Chinese name in engines/ocr/wording.py: {missing}"
    for language in ("zh_CN", "zh_TW"):
        assert all(WORDINGS[language].kind(kind) != kind for kind in named), language


@pytest.mark.slow
def test_the_workers_script_rule_is_the_apps():
    """The worker cannot import the app: its copy of the script sets must stay the app's."""
    assert (wording._SIMPLIFIED_ONLY, wording._TRADITIONAL_ONLY) == (_SIMPLIFIED_ONLY, _TRADITIONAL_ONLY)
    assert [w.shown for w in question_words("请问这个错误怎么办？告诉我一下含义")] == ["错误"]
