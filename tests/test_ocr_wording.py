"""The OCR engine's words on real programs, in English and on a Chinese desktop: figures keep every digit and their
magnitude, and kinds come from layout, not from one word.

gnumeric, mousepad and zenity run under openbox on their own Xvfb (tests/fixtures/real_desktop.py), in `C.UTF-8` or
in `zh_CN.UTF-8` (a private copy of the locale built with localedef when the system has none: zenity's buttons are
then 确定/取消, and fontconfig draws "Sans" with Noto Sans CJK, digits included). Each screen is grabbed with mss and
described through the engine's `run_one`, with window facts read from X (as the app sends them) and without. The
reader's own check (every glyph the pixels show is in the text read) and the amounts' pattern are tested on their
own first, on text rendered with the same fonts.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest

from inference_worker.engines.ocr.concepts import extract_entities
from inference_worker.engines.ocr.reader import OcrConfig, OcrReader
from tests.fixtures.text_image import font_path
from tests.test_ocr_real_windows import CORNER, DIALOG_AT, describe
from tests.test_ocr_real_windows import desktop, engine  # noqa: F401 - its module fixtures, one of each here too


LOCALES = {"en": "C.UTF-8", "zh_CN": "zh_CN.UTF-8"}
#: the figures of the sheet: repeated digits, which a recogniser short of frames per glyph merges ("22000" -> "2000")
SHEET = [("North", 22000, 18500, 21000), ("South", 11000, 11500, 13250), ("East", 33000, 9900, 10100),
         ("West", 22000, 21000, 20000), ("Total", 88000, 60900, 64350)]
#: notes whose last two lines run under the dialog opened in front (at DIALOG_AT): what shows of them is short
NOTES = {
    "en": "Team meeting notes\n\nAgenda: budget, hiring, the VPN rollout.\nRevenue last quarter was $4.2M, up from "
          "$3.9M.\nNext meeting: Thursday at 10:00.\nPasswords: rotate them every quarter.\n"
          "Usernames: firstname.lastname everywhere.\n",
    "zh_CN": "会议记录\n\n议程：预算、招聘、VPN 上线。\n上季度收入 $4.2M，全年目标 ¥3.5亿。\n安娜会重置维基的共享密码。\n"
             "下次会议：周四 10:00。\n",
}
AMOUNTS = {"en": ["amount $4.2M", "amount $3.9M"], "zh_CN": ["amount $4.2M", "amount ¥3.5亿"]}
DIALOGS = {  # (zenity arguments, title, kind) per language
    "en": {"question": (["--question", "--text=Save the changes?"], "Save changes?", "question dialog"),
           "entry": (["--entry", "--text=New name:"], "Rename", "dialog")},
    "zh_CN": {"question": (["--question", "--text=保存更改吗？"], "保存更改", "question dialog"),
              "entry": (["--entry", "--text=新名称："], "重命名", "dialog")},
}
INFO = {"en": ("Password changed", "Your password was changed.\nUse the new password next time."),
        "zh_CN": ("提示", "密码已更新，请使用新密码登录。")}
VPN = {"en": ("VPN", "Sign in to the company VPN", ["Server", "Username"], "Password"),
       "zh_CN": ("VPN 登录", "登录公司 VPN", ["服务器", "用户名"], "密码")}


@pytest.fixture(scope="module")
def home():
    """HOME and XDG folders for the programs (mousepad keeps settings and a session), in a short folder of constant
    length: mousepad's title shows the file's full path."""
    folder = Path(tempfile.mkdtemp(prefix="desk", dir="/tmp"))
    for name in ("config", "cache", "data", "runtime"):
        (folder / name).mkdir(mode=0o700)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def locale_path(home) -> dict[str, str]:
    """LOCPATH to a zh_CN.UTF-8 built here when the system has none (glibc then speaks it to zenity and GTK)."""
    listed = subprocess.run(["locale", "-a"], capture_output=True, text=True).stdout.lower().split()
    if "zh_cn.utf8" in listed:
        return {}
    if not Path("/usr/share/i18n/locales/zh_CN").is_file() or shutil.which("localedef") is None:
        pytest.fail("zh_CN.UTF-8 is neither installed nor buildable: install the Debian package `locales`.")
    built = home / "locales"
    built.mkdir()
    done = subprocess.run(["localedef", "-i", "zh_CN", "-f", "UTF-8", str(built / "zh_CN.UTF-8")],
                          capture_output=True, text=True, timeout=120)
    if not (built / "zh_CN.UTF-8" / "LC_CTYPE").is_file():
        pytest.fail(f"localedef could not build zh_CN.UTF-8: {done.stderr}")
    return {"LOCPATH": str(built)}


@pytest.fixture(params=list(LOCALES), ids=list(LOCALES))
def language(request, desktop, home, locale_path, monkeypatch):
    """The programs started in this test run in this language (LANG, LC_ALL), with their own HOME."""
    base = desktop.env

    def env(**extra: str) -> dict[str, str]:
        return {**base(**extra), "LANG": LOCALES[request.param], "LC_ALL": LOCALES[request.param], "HOME": str(home),
                "XDG_CONFIG_HOME": str(home / "config"), "XDG_CACHE_HOME": str(home / "cache"),
                "XDG_DATA_HOME": str(home / "data"), "XDG_RUNTIME_DIR": str(home / "runtime"),
                **(locale_path if request.param != "en" else {})}
    monkeypatch.setattr(desktop, "env", env)
    yield request.param
    desktop.close_all()


@contextmanager
def xft_dpi(desktop, dpi: int | None):
    """Xft.dpi on the desktop while the block runs (what a desktop sets for its font size); None: as it is."""
    if dpi is not None:
        subprocess.run(["xrdb", "-merge", "-"], input=f"Xft.dpi: {dpi}\n", text=True, env=desktop.env(), check=True)
    try:
        yield
    finally:
        if dpi is not None:
            subprocess.run(["xrdb", "-remove"], env=desktop.env(), check=True)


def notes_in_mousepad(desktop, home, language):
    if shutil.which("mousepad") is None:
        pytest.fail("mousepad is not installed (apt mousepad; scripts/test.sh installs it).")
    path = home / f"notes-{language}.txt"
    path.write_text(NOTES[language], encoding="utf-8")
    desktop.launch(["mousepad", "--disable-server", str(path)], "mousepad", at=CORNER, settle_s=2)


def both(engine, desktop):
    """The answers with window facts from X and from the pixels alone."""
    return [(with_facts, describe(engine, desktop, with_facts=with_facts)[0]) for with_facts in (True, False)]


# ------------------------------------------------------------------ figures

#: numbers that lost a repeated digit when read at 36 px (DejaVu Sans or Noto Sans CJK, size in px): each read as
#: "1000", "3,0", "2000", "1000" and "3" before the reader checked its reading against the glyphs
LOST_DIGITS = [("sans", 12, "11000"), ("sans", 9, "33,000"), ("cjk", 11, "22000"), ("cjk", 13, "11000"),
               ("cjk", 13, "33,000")]
CJK_FONT = "/usr/share/fonts/opentype/noto/NotoSansCJK-Regular.ttc"


@pytest.mark.slow
def test_a_reading_that_left_out_glyphs_the_pixels_show_is_read_again():
    from PIL import Image, ImageDraw, ImageFont

    if not Path(CJK_FONT).is_file():
        pytest.fail(f"{CJK_FONT} missing: install fonts-noto-cjk (scripts/test.sh does)")
    fonts = {"sans": font_path(), "cjk": CJK_FONT}
    reader = OcrReader(OcrConfig(warm_up_frame_px=(0, 0)))
    try:
        for font, size_px, number in LOST_DIGITS:
            image = Image.new("RGB", (240, 60), "white")
            ImageDraw.Draw(image).text((20, 20), number, fill="black", font=ImageFont.truetype(fonts[font], size_px))
            assert [line.text for line in reader.read_full(image).lines] == [number], (font, size_px, number)
    finally:
        reader.close()


def test_amounts_keep_their_magnitude_and_currency_as_written():
    texts = ["Revenue was $4.2M, up from $3.9 M.", "Budget €1.5bn", "全年目标 ¥3.5亿，上季度 ¥1.2万", "4.2M USD",
             "$2.5 million raised", "$5 bonus", "Paid $12,500.75", "3亿元"]
    found = [e.value for e in extract_entities(texts) if e.kind == "amount"]
    assert found == ["$4.2M", "$3.9 M", "€1.5bn", "¥3.5亿", "¥1.2万", "4.2M USD", "$2.5 million", "$5",
                     "$12,500.75", "3亿元"], found


def test_the_word_password_alone_names_no_sign_in_form():
    """Lines with no layout read (several images described at once): a sign-in form needs a form's layout."""
    from inference_worker.engines.ocr.concepts import describe as describe_lines
    from inference_worker.engines.ocr.reader import OcrLine

    texts = ["Your password was changed.", "Use the new password next time.", "密码已更新，请使用新密码登录。"]
    described = describe_lines([OcrLine(t, (10, 10 + 40 * i, 600, 40 + 40 * i), 0.99) for i, t in enumerate(texts)],
                               200)
    assert "login form" not in described.key_objects and described.kind != "A sign-in form", described


DESKTOP = (pytest.mark.slow, pytest.mark.desktop, pytest.mark.subprocess)


def on_the_desktop(test):
    """A test on the real desktop: slow, needs X and starts programs."""
    for mark in DESKTOP:
        test = mark(test)
    return test


@on_the_desktop
def test_a_spreadsheets_figures_keep_every_digit(engine, desktop, home, language):
    """gnumeric's default font at 10 px glyphs (Noto Sans CJK digits on the Chinese desktop; DejaVu at Xft.dpi 72
    in English) gave the recogniser two frames a glyph: 22000 came out 2000, 88000 8000, with a passing score."""
    sheet = home / f"sales-{language}.csv"
    sheet.write_text("Region,Q1,Q2,Q3\n" + "".join(",".join(map(str, row)) + "\n" for row in SHEET), encoding="utf-8")
    with xft_dpi(desktop, 72 if language == "en" else None):
        desktop.launch(["gnumeric", "--no-splash", str(sheet)], "gnumeric", at=CORNER, timeout_s=120, settle_s=3)
    for with_facts, answer in both(engine, desktop):
        assert answer["key_objects"][0] == "spreadsheet", (with_facts, answer)
        read = " " + " ".join(re.findall(r"\d+", answer["summary"])) + " "
        for name, *figures in SHEET:
            row = " ".join(map(str, figures))
            assert f" {row} " in read, (with_facts, name, row, answer["summary"])


@on_the_desktop
def test_amounts_keep_their_magnitude(engine, desktop, home, language):
    """"$4.2M" is four point two million dollars: the amount keeps its M (and 亿 its 亿), not "$4.2"."""
    notes_in_mousepad(desktop, home, language)
    for with_facts, answer in both(engine, desktop):
        for amount in AMOUNTS[language]:
            assert amount in answer["key_objects"], (with_facts, amount, answer)
        assert "amount $4.2" not in answer["key_objects"], (with_facts, answer)


# ------------------------------------------------------------------ kinds from layout

@on_the_desktop
@pytest.mark.parametrize("dialog", ["question", "entry"])
def test_a_dialog_in_front_of_notes_is_a_dialog_over_an_editor(engine, desktop, home, language, dialog):
    """The notes' lines that run under the dialog end at its edge: short, with the dialog's frame and title bar
    right of them — no captions with input boxes, whatever the notes say about passwords."""
    notes_in_mousepad(desktop, home, language)
    arguments, title, kind = DIALOGS[language][dialog]
    desktop.launch(["zenity", *arguments, f"--title={title}"], "zenity", at=DIALOG_AT)
    for with_facts, answer in both(engine, desktop):
        objects = answer["key_objects"]
        assert objects[0] == kind and not {"login form", "form"} & set(objects), (with_facts, answer)
        assert answer["summary"].startswith(f"{'A' if kind[0] not in 'aeiou' else 'An'} {kind} “"), answer
        behind = answer["summary"].partition(". Behind it, ")[2]
        assert behind.startswith("a code editor “" if with_facts else "a document “"), (with_facts, answer)
        assert "Mousepad”" in behind, (with_facts, answer)


@on_the_desktop
def test_a_message_dialog_that_mentions_a_password_is_a_dialog(engine, desktop, language):
    title, text = INFO[language]
    desktop.launch(["zenity", "--info", f"--title={title}", f"--text={text}"], "zenity", at=DIALOG_AT)
    for with_facts, answer in both(engine, desktop):
        assert answer["key_objects"][0] == "dialog" and "login form" not in answer["key_objects"], (with_facts, answer)
        assert answer["summary"].startswith("A dialog “"), (with_facts, answer)


@on_the_desktop
@pytest.mark.parametrize("theme", ["light", "dark"])
def test_a_sign_in_form_is_a_sign_in_form_in_a_light_or_dark_theme(engine, desktop, language, theme, monkeypatch):
    """Labels beside input boxes, one of them a password's: a sign-in form. A dark theme draws it light on dark, and
    light text on dark is no terminal where a form's layout explains it."""
    title, text, entries, password = VPN[language]
    if theme == "dark":
        env = desktop.env
        monkeypatch.setattr(desktop, "env", lambda **extra: {**env(**extra), "GTK_THEME": "Adwaita:dark"})
    desktop.launch(["zenity", "--forms", f"--title={title}", f"--text={text}",
                    *(f"--add-entry={entry}" for entry in entries), f"--add-password={password}"], "zenity", at=CORNER)
    for with_facts, answer in both(engine, desktop):
        objects = answer["key_objects"]
        assert objects[:2] == ["login form", "form"] and "terminal" not in objects, (with_facts, answer)
        assert answer["summary"].startswith("A sign-in form “"), (with_facts, answer)
