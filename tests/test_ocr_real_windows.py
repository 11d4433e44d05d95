"""The OCR engine on real programs under a real window manager: openbox on its own Xvfb, with xterm running a real
`python3` traceback, zenity dialogs (error, warning, question), a list, a form and a Chinese report, gnumeric
with a CSV file, xedit with Python code, xclock and xcalc — all started at test time, grabbed with mss, read by
RapidOCR through the engine's `prepare` and `run_batch` (`run_one`).

Each test checks the kind, the title and the key objects, with window facts read from the X server by
`deskeye.see.window_facts` (as the app sends them) and without (`describe --image`: pixels only). The rules under
test work from layout (boxes, colours) and facts, so none of the strings below appears in the engine's code.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import jsonschema
import pytest

from deskeye.prompt import DESKEYE_SCHEMA, build_messages, deskeye_response_format
from deskeye.see.window_facts import Region, deskeye_extension
from deskeye.see.x11_windows import windows_in_region
from inference_worker.engines.base import run_one
from inference_worker.engines.ocr.engine import OcrEngine
from inference_worker.protocol import ProtocolError, parse_chat_request, parse_window_facts
from tests.fixtures.chat_requests import png_of
from tests.fixtures.real_desktop import start_real_desktop

pytestmark = [pytest.mark.desktop, pytest.mark.subprocess]

REGION = Region(112, 84, 800, 600)            # what DeskEye watches: 800x600 of a 1024x768 screen
CORNER = (REGION.left, REGION.top)
DIALOG_AT = (300, 250)

CALC_PY = "def ratio(done, total):\n    return done / total\n\nprint(ratio(3, 0))\n"
BUDGET_CSV = ("Item,Q1,Q2,Q3\nRent,1200,1200,1250\nSalaries,8400,8650,8900\nTravel,310,275,420\n"
              "Software,99,99,149\nTotal,10009,10224,10719\n")
REPORT_TXT = ("本周工作周报\n\n1. 完成了登录模块的重构\n2. 修复了三个错误报告\n3. 预算：¥12,500，已使用 ¥8,300\n\n"
              "下周计划：性能测试与文档整理\n")
TODO_TXT = "buy milk\ncall the bank about the card\nrenew passport before June\nbook flights to Lisbon\n"
NOTES_TXT = ("Shell notes\n\nTo see what is in a folder, open a terminal and type ls -l there; the\n"
             "listing shows each file with its size. The prompt waits for your command:\n"
             "$ ls -l ~/photos\n"
             "No such file or directory means that the path is wrong,\n"
             "and Permission denied means that you may not read the file at all.\n")
LEDGER_PY = ("import json\n\n\nclass Ledger:\n    def __init__(self, path):\n        self.path = path\n\n"
             "    def total(self):\n        with open(self.path) as f:\n            rows = json.load(f)\n"
             "        return sum(r['amount'] for r in rows)\n")


@pytest.fixture(scope="module")
def desktop():
    desktop = start_real_desktop(1024, 768)
    yield desktop
    desktop.stop()


@pytest.fixture(scope="module")
def engine():
    engine = OcrEngine()
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def files():
    """The files the programs open, in a short folder of constant length (/tmp/deskXXXXXXXX): a traceback names
    the script by its full path, and pytest's own temporary paths grow with each run until the xterm line wraps."""
    folder = Path(tempfile.mkdtemp(prefix="desk", dir="/tmp"))
    for name, text in (("calc.py", CALC_PY), ("budget.csv", BUDGET_CSV), ("report.txt", REPORT_TXT),
                       ("ledger.py", LEDGER_PY), ("todo.txt", TODO_TXT), ("notes.txt", NOTES_TXT)):
        (folder / name).write_text(text, encoding="utf-8")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def screen(desktop):
    yield desktop
    desktop.close_all()


def describe(engine, desktop, *, with_facts: bool):
    """Grab the region and describe it as the app does (facts from X in the request) or as describe --image."""
    image = desktop.grab((REGION.left, REGION.top, REGION.width, REGION.height))
    facts = windows_in_region(REGION, desktop.display.name) if with_facts else []
    body = {"model": "deskeye-ocr", "messages": build_messages("What is on this screen?", png_of(image)),
            "response_format": deskeye_response_format()}
    if facts:
        body["deskeye"] = deskeye_extension(facts)
    engine.reader.reset()
    completion = run_one(engine, parse_chat_request(body))
    answer = json.loads(completion.text)
    jsonschema.validate(answer, DESKEYE_SCHEMA)
    return answer, facts


def terminal_with_traceback(desktop, files):
    shell_session(desktop, files, ["-geometry", "90x30", "-fa", "DejaVu Sans Mono", "-fs", "11"], "ana@devbox:~/proj$ ",
                  ["python3 calc.py"])


def shell_session(desktop, files, xterm_args: list[str], prompt: str, commands: list[str]):
    desktop.shell_session(xterm_args, prompt, commands, cwd=files, at=CORNER)


# ------------------------------------------------------------------ terminals and dialogs

@pytest.mark.slow
@pytest.mark.parametrize("with_facts", [True, False], ids=["facts", "pixels"])
def test_a_python_traceback_in_xterm_is_a_terminal_with_the_error_and_its_lines(engine, screen, files, with_facts):
    terminal_with_traceback(screen, files)
    answer, facts = describe(engine, screen, with_facts=with_facts)
    objects = answer["key_objects"]
    assert "terminal" in objects[:3] and "ZeroDivisionError" in objects, answer
    assert "calc.py:2" in objects and "calc.py:4" in objects, answer          # file:line, where it failed
    assert "“bash”" in answer["summary"], answer                             # xterm's title: the shell's name
    assert not re.search(r"\b(800|000|808)\b", answer["summary"]), answer     # no title-bar buttons as text
    assert not re.search(r"“[A-Z]{3,5}”", answer["summary"]), answer           # no caret rows read as capitals
    if with_facts:
        assert facts[0].title == "bash" and "xterm" in facts[0].app.lower() and facts[0].focused


@pytest.mark.slow
@pytest.mark.parametrize("with_facts", [True, False], ids=["facts", "pixels"])
def test_an_error_dialog_in_front_of_a_terminal_is_told_first_with_its_title(engine, screen, files, with_facts):
    terminal_with_traceback(screen, files)
    screen.launch(["zenity", "--error", "--title=Save failed", "--text=Could not write budget.csv:\nthe disk is full."],
                  "zenity", at=DIALOG_AT)
    answer, facts = describe(engine, screen, with_facts=with_facts)
    assert answer["key_objects"][0] == "error dialog", answer
    assert answer["summary"].startswith("An error dialog “Save failed”: "), answer
    dialog_part, _, behind = answer["summary"].partition("Behind it")
    assert "budget.csv" in dialog_part, answer                               # the dialog's own text, first
    assert "terminal" in answer["key_objects"] and "“bash”" in behind, answer
    if with_facts:
        assert [f.title for f in facts] == ["Save failed", "bash"] and facts[0].focused


@pytest.mark.slow
@pytest.mark.parametrize(("flag", "title", "text", "kind"), [
    ("--warning", "Unsaved changes", "The document has unsaved changes.\nThey will be lost if you close it.",
     "warning dialog"),
    ("--question", "Delete file?", "Delete the file report.txt permanently?", "question dialog"),
    ("--error", "Backup", "The backup did not finish: the server stopped answering.", "error dialog"),
])
def test_dialog_flavours_from_title_icon_and_wording(engine, screen, flag, title, text, kind):
    screen.launch(["zenity", flag, f"--title={title}", f"--text={text}"], "zenity", at=DIALOG_AT)
    for with_facts in (True, False):
        answer, _ = describe(engine, screen, with_facts=with_facts)
        assert answer["key_objects"][0] == kind, (with_facts, answer)
        assert answer["summary"].startswith(f"{'An' if kind[0] in 'ae' else 'A'} {kind} “{title}”: "), answer


# ------------------------------------------------------------------ terminals from the monospace grid

XTERM_FONTS = {"mono10": ["-fa", "Monospace", "-fs", "10"], "mono14": ["-fa", "Monospace", "-fs", "14"],
               "bitmap": []}                                    # no -fa: xterm's core "fixed" bitmap font
XTERM_COLOURS = {"light": ["-bg", "white", "-fg", "black"], "dark": ["-bg", "black", "-fg", "white"]}
SHELL_COMMANDS = ["ls -l", "cat todo.txt", "wc -l todo.txt calc.py"]


def view_of(engine, desktop, title: str):
    """The window titled `title` as the engine segments it (facts from X), with its faithful lines."""
    from inference_worker.engines.ocr.reader import to_bgr
    from inference_worker.engines.ocr.screen import faithful_lines
    from inference_worker.engines.ocr.windows import segment

    image = desktop.grab((REGION.left, REGION.top, REGION.width, REGION.height))
    bgr = to_bgr(image)
    facts = windows_in_region(REGION, desktop.display.name)
    engine.reader.reset()
    view = next(v for v in segment(engine.reader.read(image).lines, bgr, facts) if v.title == title)
    return faithful_lines(view.lines, bgr), bgr, view


@pytest.mark.slow
@pytest.mark.parametrize("colour", XTERM_COLOURS)
@pytest.mark.parametrize("font", XTERM_FONTS)
def test_a_shell_session_on_a_monospace_grid_is_a_terminal_light_or_dark(engine, screen, files, font, colour):
    """`% ` is no prompt the prompt pattern knows, and a light xterm is not dark: the grid of the text and what the
    shell printed (an `ls -l` listing) make it a terminal, from the pixels alone too."""
    from inference_worker.engines.ocr.monospace import monospace_grid

    columns = 60 if font == "mono14" else 92                 # the window fits the region: its width is known
    shell_session(screen, files, [*XTERM_COLOURS[colour], "-geometry", f"{columns}x30", *XTERM_FONTS[font]], "% ",
                  SHELL_COMMANDS)
    lines, bgr, view = view_of(engine, screen, "bash")
    grid = monospace_grid(lines, bgr)
    assert grid is not None, [ln.text for ln in lines]
    expected_cell_px = (view.width - 2 * 2) / columns          # xterm's client area: columns x cell + 2 px borders
    assert abs(grid.cell_px - expected_cell_px) <= 0.15, (grid, expected_cell_px)
    assert grid.left_px - view.box[0] <= 2 + grid.cell_px / 2, (grid, view.box)   # the lattice starts at the margin
    for with_facts in (True, False):
        answer, _ = describe(engine, screen, with_facts=with_facts)
        assert answer["key_objects"][0] == "terminal", (with_facts, answer)
        assert answer["summary"].startswith("A terminal “bash”: "), (with_facts, answer)
        assert re.search(r"calc\.p|budget|report|todo", answer["summary"]), answer   # what the shell printed


@pytest.mark.slow
def test_a_terminal_with_no_prompt_shown_is_told_by_its_grid_and_commands(engine, screen, files):
    shell_session(screen, files, [*XTERM_COLOURS["light"], "-geometry", "84x28", "-fa", "Monospace", "-fs", "12"], "",
                  ["cat todo.txt", "wc -l todo.txt calc.py", "ls /usr/share | head -12"])
    answer, _ = describe(engine, screen, with_facts=False)
    assert answer["key_objects"][0] == "terminal" and answer["summary"].startswith("A terminal “bash”: "), answer


@pytest.mark.slow
def test_source_code_on_a_monospace_grid_is_a_code_editor(engine, screen, files):
    """xterm showing a file with `less` has the grid, not a shell session: what a person calls it depends on what
    is shown; the monospace measure alone does not make a terminal."""
    from inference_worker.engines.ocr.monospace import monospace_grid

    shell_session(screen, files, [*XTERM_COLOURS["light"], "-geometry", "88x30", "-fa", "Monospace", "-fs", "12",
                                  "-T", "ledger.py"], "", ["clear; cat ledger.py"])
    lines, bgr, _ = view_of(engine, screen, "ledger.py")
    assert monospace_grid(lines, bgr) is not None, [ln.text for ln in lines]
    answer, _ = describe(engine, screen, with_facts=True)
    assert answer["key_objects"][0] == "code editor", answer
    assert "class Ledger:" in answer["summary"], answer


@pytest.mark.slow
@pytest.mark.parametrize("with_facts", [True, False], ids=["facts", "pixels"])
def test_a_proportional_document_about_the_shell_is_not_a_terminal(engine, screen, files, with_facts):
    """Its lines quote a prompt (`$ ls -l ~/photos`, which alone makes a terminal) and a shell's errors, in a
    proportional font: the measure says so and it stays a document."""
    from inference_worker.engines.ocr.monospace import is_proportional, monospace_grid

    screen.launch(["zenity", "--text-info", "--title=notes.txt", "--width=720", "--height=400",
                   f"--filename={files / 'notes.txt'}"], "zenity", at=CORNER)
    lines, bgr, _ = view_of(engine, screen, "notes.txt")
    assert monospace_grid(lines, bgr) is None and is_proportional(lines, bgr), [ln.text for ln in lines]
    answer, _ = describe(engine, screen, with_facts=with_facts)
    assert answer["key_objects"][0] == "document" and "terminal" not in answer["key_objects"], answer
    screen.close_all()
    screen.launch(["zenity", "--error", "--title=Copy failed", "--text=cp: cannot stat notes.txt:\n"
                   "No such file or directory"], "zenity", at=DIALOG_AT)
    answer, _ = describe(engine, screen, with_facts=with_facts)
    assert answer["key_objects"][0] == "error dialog" and "terminal" not in answer["key_objects"], answer


# ------------------------------------------------------------------ tables, editors, clocks

@pytest.mark.slow
def test_a_gnumeric_spreadsheet_is_a_spreadsheet_with_its_title(engine, screen, files):
    screen.launch(["gnumeric", "--no-splash", str(files / "budget.csv")], "gnumeric", at=CORNER, timeout_s=120,
                  settle_s=3)
    answer, facts = describe(engine, screen, with_facts=True)
    assert answer["key_objects"][0] == "spreadsheet", answer
    assert facts[0].title.startswith("budget.csv") and f"“{facts[0].title}”" in answer["summary"], answer
    assert not re.search(r"[\u3400-\u9fff]", answer["summary"]), answer       # toolbar icons are not Chinese
    pixels, _ = describe(engine, screen, with_facts=False)
    assert pixels["key_objects"][0] == "spreadsheet", pixels
    screen.launch(["zenity", "--error", "--title=Save failed", "--text=Could not write budget.csv:\nthe disk is full."],
                  "zenity", at=DIALOG_AT)                     # hides some of the cells and column letters
    for with_facts in (True, False):
        answer, _ = describe(engine, screen, with_facts=with_facts)
        assert answer["key_objects"][:2] == ["error dialog", "spreadsheet"], (with_facts, answer)
        assert answer["summary"].startswith("An error dialog “Save failed”: "), answer


@pytest.mark.slow
def test_xedit_with_python_code_is_a_code_editor(engine, screen, files):
    screen.launch(["xedit", "-geometry", "780x560", str(files / "ledger.py")], "xedit", at=CORNER)
    for with_facts in (True, False):
        answer, _ = describe(engine, screen, with_facts=with_facts)
        assert answer["key_objects"][0] == "code editor", (with_facts, answer)
        assert "class Ledger:" in answer["summary"], answer


@pytest.mark.slow
def test_xclock_and_xcalc_are_a_clock_and_a_calculator(engine, screen):
    screen.launch(["xclock", "-digital", "-geometry", "360x60", "-face", "DejaVu Sans-20"], "xclock", at=(130, 100))
    screen.launch(["xcalc", "-geometry", "300x420"], "xcalc", at=(500, 200))
    answer, facts = describe(engine, screen, with_facts=True)
    assert {f.title for f in facts} >= {"Calculator", "xclock"}, facts
    assert answer["key_objects"][0] == "calculator" and "clock" in answer["key_objects"], answer
    assert answer["summary"].startswith("A calculator “Calculator”: "), answer     # focused: started last
    pixels, _ = describe(engine, screen, with_facts=False)
    assert {"calculator", "clock"} <= set(pixels["key_objects"]), pixels


# ------------------------------------------------------------------ words inside windows

@pytest.mark.slow
def test_a_chinese_report_is_a_document_and_keeps_its_amounts(engine, screen, files):
    screen.launch(["zenity", "--text-info", "--title=周报 - report.txt", "--width=700", "--height=500",
                   f"--filename={files / 'report.txt'}"], "zenity", at=CORNER)
    for with_facts in (True, False):
        answer, _ = describe(engine, screen, with_facts=with_facts)
        objects = answer["key_objects"]
        assert objects[0] == "document", (with_facts, answer)
        assert not {"error dialog", "login form", "error"} & set(objects), answer   # 错误, 登录 are just words
        assert "amount ¥12,500" in objects and "amount ¥8,300" in objects, answer
        assert "“周报" in answer["summary"] and "本周工作周报" in answer["summary"], answer


@pytest.mark.slow
def test_an_inbox_list_is_not_a_sign_in_form(engine, screen):
    rows = ["IT Support", "Password expires in 3 days", "09:12", "Alice Chen", "Quarterly numbers", "08:40",
            "GitHub", "CI passed on main", "Yesterday", "Bob", "Lunch on Thursday?", "Mon"]
    screen.launch(["zenity", "--list", "--title=Inbox - Mail", "--width=760", "--height=520", "--column=From",
                   "--column=Subject", "--column=Received", *rows], "zenity", at=CORNER)
    answer, _ = describe(engine, screen, with_facts=True)
    assert answer["key_objects"][0] == "email inbox", answer
    assert "login form" not in answer["key_objects"] and "form" not in answer["key_objects"], answer
    assert answer["summary"].startswith("An email inbox “Inbox - Mail”: "), answer


@pytest.mark.slow
def test_labelled_fields_make_a_form(engine, screen):
    screen.launch(["zenity", "--forms", "--title=New account", "--text=Create your account", "--add-entry=Full name",
                   "--add-entry=Email", "--add-entry=Phone"], "zenity", at=CORNER)
    answer, _ = describe(engine, screen, with_facts=True)
    assert answer["key_objects"][0] == "form", answer
    assert answer["summary"].startswith("A form “New account”: "), answer


# ------------------------------------------------------------------ window facts

OWN_WINDOW = textwrap.dedent("""
    import sys, tkinter as tk
    root = tk.Tk(className="DeskEye")
    root.title("DeskEye overlay")
    root.geometry("300x80+200+150")
    tk.Label(root, text="DeskEye: an answer").pack()
    root.update()
    print("shown", flush=True)
    sys.stdin.readline()
""")


@pytest.mark.slow
def test_window_facts_list_the_region_front_first_without_deskeyes_own_windows(screen, files):
    terminal_with_traceback(screen, files)
    own = subprocess.Popen([sys.executable, "-c", OWN_WINDOW], env=screen.env(), stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    try:
        assert own.stdout.readline().strip() == "shown"
        time.sleep(0.5)
        titles = {t for _, t in screen.client_windows()}
        assert any("deskeye" in t.lower() for t in titles), titles           # it is there, on top
        facts = windows_in_region(REGION, screen.display.name)
        assert [f.title for f in facts] == ["bash"], facts
        bash = facts[0]
        assert bash.frame[0] == 0 and bash.frame[1] == 0                      # moved to the region's corner
        assert bash.box[1] > bash.frame[1]                                    # the title bar is above the client
    finally:
        own.stdin.close()
        own.wait(timeout=10)
    outside = windows_in_region(Region(1000, 700, 24, 24), screen.display.name)
    assert outside == [], outside


def test_window_facts_travel_in_the_request_and_bad_ones_are_named():
    facts = parse_window_facts({"windows": [{"title": "Save failed", "app": "zenity Zenity", "box": [10, 30, 200, 150],
                                             "frame": [9, 10, 201, 151], "focused": True}]})
    body = {"model": "x", "messages": build_messages("What?", None), "deskeye": deskeye_extension(facts)}
    assert parse_chat_request(body).windows == facts
    assert parse_chat_request({"model": "x", "messages": build_messages("What?", None)}).windows == ()
    for bad, named in [({"windows": "x"}, "deskeye.windows must be a list"),
                       ({"windows": [{"title": 3, "box": [0, 0, 1, 1]}]}, r"deskeye.windows\[0\].title"),
                       ({"windows": [{"box": [0, 0, 1]}]}, r"\[0\].box must be \[left, top, right, bottom\]"),
                       ({"windows": [{"box": [5, 0, 1, 1]}]}, "right > left"),
                       ({"windows": [{"box": [0, 0, 1, 1]}] * 33}, "at most 32"), ("x", "'deskeye' must be")]:
        with pytest.raises(ProtocolError, match=named):
            parse_window_facts(bad)
    long = parse_window_facts({"windows": [{"title": "\x1b[31m" + "t" * 5000, "box": [0, 0, 1, 1]}]})
    assert len(long[0].title) <= 200 and "\x1b" not in long[0].title


# ------------------------------------------------------------------ faithful text (rendered, no X needed)

def render_rows(rows: list[str], *, background: str = "white", ink: str = "black"):
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.truetype("/usr/share/fonts/truetype/dejavu/DejaVuSansMono.ttf", 18)
    image = Image.new("RGB", (640, 40 * len(rows) + 20), background)
    draw = ImageDraw.Draw(image)
    for i, row in enumerate(rows):
        draw.text((10, 10 + 40 * i), row, fill=ink, font=font)
    return image


@pytest.mark.slow
def test_caret_and_tilde_rows_are_not_told_as_letters():
    from inference_worker.engines.ocr.reader import OcrConfig, OcrReader, to_bgr
    from inference_worker.engines.ocr.screen import faithful_lines

    rows = ["    return done / total", "           ~~~~~^~~~~~", "    print(ratio(3, 0))", "          ^^^^^^^^^^^",
            "ZeroDivisionError: division by zero"]
    symbol_rows, symbols_read = {1, 3}, []
    for background, ink in (("white", "black"), ("black", "#e0e0e0")):
        image = render_rows(rows, background=background, ink=ink)
        read = OcrReader(OcrConfig(min_score=0.0)).read(image).lines      # everything the recogniser says
        row_of = {line: round((line.center[1] - 10 - 11) / 40) for line in read}
        kept = faithful_lines(read, to_bgr(image))
        assert not [line.text for line in kept if row_of[line] in symbol_rows], (background, read)
        assert {row_of[line] for line in kept} == {0, 2, 4}, (background, kept)
        symbols_read += [line.text for line in read if row_of[line] in symbol_rows]
    assert symbols_read, "the recogniser read no symbol row: this test would not show the filter"


def test_numbers_keep_separators_and_currency_and_errors_and_sources_become_objects():
    from inference_worker.engines.ocr.concepts import extract_entities

    texts = ["3.预算:¥12,500,已使用¥8,300", "Total €1.249,50 due", "Paid $12,500.75", "Balance ¥12.500",
             'File "/home/ana/app.py", line 41, in load', "json.decoder.JSONDecodeError: Expecting value",
             "KeyErrort'port'", "main.c:12:5: error: expected ';'", "ErrorHandler ready", "Errors: 0"]
    found = [(e.kind, e.value) for e in extract_entities(texts)]
    for expected in [("amount", "¥12,500"), ("amount", "¥8,300"), ("amount", "€1.249,50"), ("amount", "$12,500.75"),
                     ("amount", "¥12.500"), ("source line", "app.py:41"), ("source line", "main.c:12"),
                     ("error name", "JSONDecodeError"), ("error name", "KeyError")]:
        assert expected in found, (expected, found)
    assert not any(value in ("ErrorHandler", "Errors", "¥12.50") for _, value in found), found


def test_a_line_seen_before_is_not_recognised_again():
    from inference_worker.engines.ocr.reader import OcrReader

    reader = OcrReader()
    first = reader.read(render_rows(["Quarterly budget review", "Invoice 4471 overdue"]))
    hits_before = reader.num_rec_cache_hits
    moved = render_rows(["Invoice 4471 overdue", "Quarterly budget review"])     # the same lines, swapped
    again = reader.read_full(moved)
    assert sorted(ln.text for ln in again.lines) == sorted(ln.text for ln in first.lines)
    assert reader.num_rec_cache_hits - hits_before == 2                        # both crops came from the cache
    reader.clear_cache()
    assert [ln.text for ln in reader.read(moved).lines] == [ln.text for ln in again.lines]
    assert reader.num_rec_cache_hits - hits_before == 2


# ------------------------------------------------------------------ the app's path: capture -> client -> worker

@pytest.mark.slow
def test_the_app_sends_the_window_facts_and_the_worker_tells_the_foreground_dialog_first(screen, files, monkeypatch):
    """Real capture (mss + window facts from X) -> WorkerClient (openai) -> a supervised `deskeye-worker --engine
    ocr` subprocess: the foreground dialog is told first, under the title X gives it."""
    from deskeye.see.capture import grab_frame
    from deskeye.worker.client import WorkerClient
    from deskeye.settings import Settings, with_overrides
    from deskeye.worker.supervisor import WorkerSupervisor

    terminal_with_traceback(screen, files)
    screen.launch(["zenity", "--error", "--title=Disk full", "--text=No space left on the device."], "zenity",
                  at=DIALOG_AT)
    monkeypatch.setenv("DISPLAY", screen.display.name)          # the app captures this desktop
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    settings = with_overrides(Settings(), capture={"region": "112,84,800,600"},
                              worker={"engine": "ocr", "startup_timeout_s": 60.0, "request_timeout_s": 60.0})
    frame = grab_frame(settings)
    assert [w.title for w in frame.windows] == ["Disk full", "bash"], frame.windows
    supervisor = WorkerSupervisor(settings)
    client = WorkerClient(supervisor, settings)
    try:
        supervisor.start()
        answer = client.ask("What is on this screen?", frame.png(), windows=frame.windows)
    finally:
        client.close()
        supervisor.stop()
    assert answer.engine == "ocr"
    assert answer.summary.startswith("An error dialog “Disk full”: "), answer
    assert answer.key_objects[0] == "error dialog" and "terminal" in answer.key_objects, answer


@pytest.mark.slow
def test_any_window_facts_give_an_answer_inside_the_schema():
    """Facts are request content (untrusted): windows off the frame, empty, nested, with hostile titles."""
    import random

    image = render_rows(["Quarterly budget review", "Invoice 4471 overdue", "$ python3 calc.py", "OK"])
    engine = OcrEngine()
    rng = random.Random(7)
    try:
        for trial in range(12):
            windows = []
            for _ in range(rng.randint(1, 32)):
                left, top = rng.randint(-2000, 900), rng.randint(-2000, 400)
                box = [left, top, left + rng.randint(1, 3000), top + rng.randint(1, 3000)]
                windows.append({"title": rng.choice(["", "“quoted” \"json\"", "\x1b[31mred", "x" * 400, "错误 dialog"]),
                                "app": rng.choice(["", "xterm XTerm", "DeskEye DeskEye"]), "box": box,
                                "focused": rng.random() < 0.2})
            body = {"model": "x", "messages": build_messages("What is on this screen?", png_of(image)),
                    "response_format": deskeye_response_format(), "deskeye": {"windows": windows}}
            answer = json.loads(run_one(engine, parse_chat_request(body)).text)
            jsonschema.validate(answer, DESKEYE_SCHEMA)
    finally:
        engine.close()
