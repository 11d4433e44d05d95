"""What kind of window a window is, from how its text is laid out (OCR box geometry), its colours and its
window facts — not from single words: a word inside a document does not change what the window is.

Each rule reads structure: a calculator is a keypad grid of digits; a clock is one large time; a spreadsheet is a
cell grid with its column letters or row numbers; a terminal has a shell prompt, or shows a shell session (a
traceback, `ls` rows, loose prompts) in a monospace grid (`monospace`) or light text on a dark screen, dark or light
theme alike, and source code alone on a grid is a code editor's; a code editor has indented code lines; a form has
labels with empty input boxes beside them (in its own pixels: not where a window in front covers it); a list or inbox
has rows aligned in columns; a dialog is a short block of text with a row of short buttons right under it, and its
flavour (error, warning, question) comes from its title, its icon's colour and its wording together. Light text on a
dark screen with no shell in it is a terminal only when none of those layouts explains it (a dark theme's form is a
form). The program's class (WM_CLASS, from the facts) only decides when the
pixels cannot (an analog clock). The measures the rules read (rows, aligned columns, input boxes) are in
`geometry`.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from inference_worker.engines.ocr.concepts import clean, term_in
from inference_worker.engines.ocr.geometry import (clusters, field_right_of, grid_columns, has_column_letters,
                                                   has_row_numbers, is_dark_behind_text, is_label)
from inference_worker.engines.ocr.monospace import Grid, is_proportional, monospace_grid
from inference_worker.engines.ocr.reader import OcrLine
from inference_worker.engines.ocr.vocabulary import ERROR_TERMS, WARNING_TERMS
from inference_worker.engines.ocr.windows import WindowView


@dataclass(frozen=True)
class Kind:
    label: str                  # the key_object, e.g. "error dialog"
    screen: str                 # how the summary names it, e.g. "An error dialog"


KINDS = {
    "calculator": Kind("calculator", "A calculator"), "clock": Kind("clock", "A clock"),
    "spreadsheet": Kind("spreadsheet", "A spreadsheet"), "table": Kind("table", "A table"),
    "terminal": Kind("terminal", "A terminal"), "code editor": Kind("code editor", "A code editor"),
    "form": Kind("form", "A form"), "email inbox": Kind("email inbox", "An email inbox"),
    "list": Kind("list", "A list"), "dialog": Kind("dialog", "A dialog"),
    "error dialog": Kind("error dialog", "An error dialog"),
    "warning dialog": Kind("warning dialog", "A warning dialog"),
    "question dialog": Kind("question dialog", "A question dialog"),
    "document": Kind("document", "A document"),
}

#: program classes (WM_CLASS words, case-folded) that name the kind when the layout cannot tell
APP_KINDS = (
    (("xterm", "uxterm", "urxvt", "rxvt", "terminal", "konsole", "alacritty", "kitty", "terminator", "tilix",
      "st-256color", "foot", "wezterm"), "terminal"),
    (("xclock", "clock", "oclock"), "clock"),
    (("xcalc", "calculator", "galculator", "kcalc", "qalculate"), "calculator"),
    (("gnumeric", "libreoffice-calc", "localc", "soffice-calc", "et"), "spreadsheet"),
    (("xedit", "gedit", "mousepad", "kate", "kwrite", "code", "emacs", "gvim", "geany", "pluma", "leafpad",
      "sublime_text", "jetbrains-pycharm"), "code editor"),
    (("thunderbird", "evolution", "geary", "claws-mail", "kmail"), "email inbox"),
)

PROMPT = re.compile(                       # a shell prompt at a line's start (not "$12.50", not "# Heading")
    r"^\s*(?:\([\w.-]+\)\s)?[\w.-]+@[\w.-]+(?::\S*)?\s?[$#%>❯]\s*(?![\d.,])"     # user@host:~/path$
    r"|^\s*(?:\([\w.-]+\)\s)?\S*[~/]\S*\s?[$#%❯]\s*(?![\d.,])(?:\S|$)"             # ~/proj$  /tmp #
    r"|^\s*\$(?:\s+(?![\d.,])\S|\s*[a-z]|\s*$)"                                      # $ command
    r"|^\s*>>>\s|^\s*PS [A-Z]:\\[^>]*>|^\s*[A-Z]:\\[^>]*>")
CODE_LINE = re.compile(r"^\s*(def|class|import|from|return|if|elif|else|for|while|with|try|except|function|const|"
                       r"let|var|public|private|static|#include|fn|func|package)\b|[;{}]\s*$|^\s*[\w.]+\s*=\s*\S|"
                       r"\)\s*:\s*$")
#: what a shell prints (on a monospace grid or dark screen it makes a terminal): a traceback, `ls -l` rows, the
#: total `ls -l`/`du` print, a shell's own errors
SHELL_OUTPUT = re.compile(r"^Traceback \(most recent call last\)|^\s*File \"[^\"]+\", line \d+"
                          r"|^[-dlcbps][-rwxsStT]{9}[.+@]?(\s|\d|$)|^total \d+$"
                          r"|command not found|No such file or directory|Permission denied|^bash: |^zsh: ")
#: a command typed at a prompt the terminal no longer shows (PS1 empty, or scrolled): a common program with an
#: option or a path among its arguments (not "make sure the file exists."), or a pipe into one
COMMAND_LINE = re.compile(r"^(?:sudo\s+)?(?:ls|cd|cat|grep|wc|git|python3?|pip3?|make|echo|ssh|docker|npm|head|"
                          r"tail|find|less|cp|mv|rm|mkdir|chmod|curl|wget|apt|apt-get|ps|df|du|tar|kill|man)"
                          r"(?:\s+\S+){1,8}$")
COMMAND_ARG = re.compile(r"\s(?:-{1,2}[A-Za-z][\w-]*|\S*[/~*]\S*|\w[\w-]*\.\w{1,5})(?=\s|$)")
PIPE = re.compile(r"\S\s\|\s*(?:head|tail|grep|wc|sort|less|uniq)\b")
TIME_TEXT = re.compile(r"(?<!\d)([01]?\d|2[0-3]):[0-5]\d(:[0-5]\d)?(?!\d)")
DIGIT_KEY = re.compile(r"^[0-9]$")
OPERATOR_KEY = re.compile(r"^([+\-×÷*/=%.]|\+/-|AC|C|CE|CE/C)$")
SHORT_BUTTON_CHARS = 14
QUESTION_WORDS = ("?", "？", "are you sure", "do you want", "would you like", "确定要", "是否")


def classify(view: WindowView, bgr: np.ndarray) -> Kind | None:
    """The window's kind, or None when its layout says nothing (then its words may)."""
    lines = [ln for ln in view.lines if clean(ln.text)]
    for rule in (_calculator, _clock, _spreadsheet, _terminal, _code_editor, _form, _list, _table):
        kind = rule(lines, view, bgr)
        if kind is not None:
            return KINDS[kind]
    dialog = _dialog(lines, view, bgr)
    if dialog is not None:
        return KINDS[dialog]
    if _dark_session(lines, view, bgr):
        return KINDS["terminal"]
    app_kind = kind_of_app(view.app)
    if app_kind is not None:
        return KINDS[app_kind]
    if _document(lines):
        return KINDS["document"]
    return None


def kind_of_app(app: str) -> str | None:
    words = set(app.casefold().split())
    return next((kind for names, kind in APP_KINDS if words & set(names)), None)


# -------------------------------------------------------------------- rules

def _calculator(lines, view, bgr) -> str | None:
    digits = [ln for ln in lines if DIGIT_KEY.match(clean(ln.text))]
    if len({clean(ln.text) for ln in digits}) < 7:
        return None
    columns = clusters([ln.center[0] for ln in digits], tolerance=8)
    rows = clusters([ln.center[1] for ln in digits], tolerance=8)
    if len([c for c in columns if c >= 2]) >= 3 and len([r for r in rows if r >= 2]) >= 3:
        return "calculator"
    return None


def _clock(lines, view, bgr) -> str | None:
    timed = [ln for ln in lines if TIME_TEXT.search(clean(ln.text))]
    if not timed or len(lines) > 3:
        return "clock" if not lines and kind_of_app(view.app) == "clock" else None
    biggest = max(lines, key=lambda ln: ln.height)
    return "clock" if biggest in timed else None


def _spreadsheet(lines, view, bgr) -> str | None:
    """A cell grid with its headers: column letters in order along one row, or row numbers down one column."""
    letters, numbers = has_column_letters(lines), has_row_numbers(lines)
    if letters and numbers:
        return "spreadsheet"                   # the sheet's own frame, even with no figures in it yet
    if grid_columns(lines, min_rows=3, numeric=True) < 2:
        return None
    return "spreadsheet" if letters or numbers else None


def _table(lines, view, bgr) -> str | None:
    return "table" if grid_columns(lines, min_rows=3, numeric=True) >= 3 else None


def _terminal(lines, view, bgr) -> str | None:
    """A shell prompt; or, in a terminal's class (or none known), text on a monospace grid or light on dark that
    reads as a shell session (loose prompts at the margin, a traceback, `ls` listings, a shell's errors) rather
    than as source code (which a code editor shows on a grid too)."""
    if any(PROMPT.match(clean(ln.text)) for ln in lines):
        # a document quoting a shell session is not a terminal; lines of no known window may mix several
        return None if view.source != "screen" and is_proportional(lines, bgr) else "terminal"
    if kind_of_app(view.app) not in (None, "terminal"):
        return None
    grid = monospace_grid(lines, bgr)
    dark = len(lines) >= 3 and is_dark_behind_text(bgr, lines)
    if grid is None and not dark:
        return None
    texts = [clean(ln.text) for ln in lines]
    if any(SHELL_OUTPUT.search(t) for t in texts) or _prompts_at_margin(lines, grid, "$%❯") \
            or (grid is not None and any(_is_command(t) and not CODE_LINE.search(t) for t in texts)):
        return "terminal"
    if _code_editor(lines, view, bgr) is not None:
        return None                         # source code on a grid: an editor, unless a shell is seen above
    return "terminal" if _prompts_at_margin(lines, grid, "#>") >= 2 else None


def _dark_session(lines, view, bgr) -> bool:
    """Light text on a dark screen that no layout explains (no form, list, table or dialog: a dark theme draws
    those light on dark too) and no program class names otherwise: what is left of a terminal's session."""
    return kind_of_app(view.app) in (None, "terminal") and len(lines) >= 3 and is_dark_behind_text(bgr, lines)


def _prompts_at_margin(lines: Sequence[OcrLine], grid: Grid | None, marks: str) -> int:
    """Lines that start at the grid's left margin with a prompt mark and then a command with an option or a path
    (or nothing: the prompt waiting at the bottom); not a `% comment` or `$var = 1;` line."""
    if grid is None:
        return 0
    count = 0
    for line in lines:
        text = clean(line.text)
        if abs(line.box[0] - grid.left_px) > 1.5 * grid.cell_px or not text or text[0] not in marks:
            continue
        rest = text[1:].strip()
        count += not CODE_LINE.search(text) and (not rest or bool(COMMAND_ARG.search(" " + rest)))
    return count


def _is_command(text: str) -> bool:
    return bool(PIPE.search(text)) or bool(COMMAND_LINE.match(text) and COMMAND_ARG.search(text))


def _code_editor(lines, view, bgr) -> str | None:
    code = [ln for ln in lines if CODE_LINE.search(clean(ln.text))]
    indents = clusters([ln.box[0] for ln in code], tolerance=6)
    return "code editor" if len(code) >= 3 and len(indents) >= 2 else None


def _form(lines, view, bgr) -> str | None:
    if has_row_numbers(lines) or has_column_letters(lines):
        return None                            # a sheet's cells are boxes beside words too
    labels = [ln for ln in lines if is_label(ln, lines, view) and field_right_of(ln, bgr, view)]
    lefts = clusters([ln.box[0] for ln in labels], tolerance=12)
    return "form" if labels and max(lefts) >= 2 else None


def _list(lines, view, bgr) -> str | None:
    if grid_columns(lines, min_rows=3, numeric=False) < 2:
        return None
    times = sum(1 for ln in lines if TIME_TEXT.search(clean(ln.text)) or _is_day_word(clean(ln.text)))
    mail = sum(1 for ln in lines if re.match(r"(?i)^(from|subject|sender|received|to|date)\b", clean(ln.text)))
    return "email inbox" if times >= 2 and (mail >= 1 or kind_of_app(view.app) == "email inbox") else "list"


def _dialog(lines, view, bgr) -> str | None:
    """Short text block + a row of short buttons right under it; the flavour from title, icon and wording."""
    buttons = _button_row(lines, view)
    if not buttons:
        return None
    text = [ln for ln in lines if ln not in buttons and ln.box[3] <= buttons[0].box[1]]
    if not text or len(text) > 8:
        return None
    gap = buttons[0].box[1] - max(ln.box[3] for ln in text)
    if gap > 4 * max(ln.height for ln in text):
        return None                         # a big empty pane between them: a window with buttons, not a message
    return _flavour(view, text, buttons, bgr)


def _document(lines) -> bool:
    prose = [ln for ln in lines
             if len(clean(ln.text).split()) >= 4 or len(re.findall(r"[\u3400-\u9fff]", ln.text)) >= 8]
    return len(prose) >= 3


# -------------------------------------------------------------------- dialog flavour

def _flavour(view: WindowView, text: Sequence[OcrLine], buttons: Sequence[OcrLine], bgr: np.ndarray) -> str:
    words = [view.title or ""] + [ln.text for ln in text]
    votes = Counter()
    if any(term_in(t, w) for t in ERROR_TERMS for w in words):
        votes["error dialog"] += 1
    if any(term_in(t, w) for t in WARNING_TERMS for w in words):
        votes["warning dialog"] += 1
    if any(q in clean(w).lower() for q in QUESTION_WORDS for w in words[1:]) or \
            {clean(b.text).lower() for b in buttons} & {"yes", "no", "是", "否"}:
        votes["question dialog"] += 1
    icon = icon_hue(bgr, view, text)
    if icon is not None:
        votes[icon] += 1.5                   # the icon is the toolkit's own statement of the flavour
    if not votes:
        return "dialog"
    best, score = votes.most_common(1)[0]
    return best if score >= 1 else "dialog"


def icon_hue(bgr: np.ndarray, view: WindowView, text: Sequence[OcrLine]) -> str | None:
    """The flavour a dialog's icon colour says: red = error, yellow/orange = warning, blue = question; the icon is
    the colourful blob left of the text block."""
    left = max(view.box[0], min(ln.box[0] for ln in text) - 80)
    right = min(ln.box[0] for ln in text) - 2
    top, bottom = max(view.box[1], text[0].box[1] - 30), min(view.box[3], text[-1].box[3] + 30)
    if right - left < 12 or bottom - top < 12:
        return None
    patch = bgr[top:bottom, left:right].reshape(-1, 3).astype(int)
    b, g, r = patch[:, 0], patch[:, 1], patch[:, 2]
    chroma = patch.max(axis=1) - patch.min(axis=1)
    vivid = chroma > 80
    if vivid.sum() < 30:
        return None
    rows, columns = np.divmod(np.flatnonzero(vivid), right - left)
    blob_h, blob_w = rows.max() - rows.min() + 1, columns.max() - columns.min() + 1
    if not (12 <= blob_h and 0.5 <= blob_w / blob_h <= 2.0):
        return None                                  # a stripe or a rule, not an icon
    r, g, b = r[vivid], g[vivid], b[vivid]
    counts = {"error dialog": int(((r > g + 60) & (r > b + 60) & (g < 140)).sum()),
              "warning dialog": int(((r > b + 80) & (g > b + 50) & (g >= 140)).sum()),
              "question dialog": int(((b > r + 40) & (b >= g)).sum())}
    best = max(counts, key=counts.get)
    return best if counts[best] >= 0.4 * int(vivid.sum()) else None


# -------------------------------------------------------------------- the button row

def _button_row(lines: Sequence[OcrLine], view: WindowView) -> list[OcrLine]:
    """The lowest row of short labels in the window's lower part, nothing under it: its buttons (left to right)."""
    row = button_row(lines)
    return row if row and row[0].center[1] >= view.box[1] + 0.5 * view.height else []


def button_row(lines: Sequence[OcrLine]) -> list[OcrLine]:
    """The lowest row of lines when it is 1-4 short labels (left to right), else []."""
    if not lines:
        return []
    lowest = max(lines, key=lambda ln: ln.center[1])
    row = [ln for ln in lines if abs(ln.center[1] - lowest.center[1]) <= max(6, lowest.height / 2)]
    if len(row) > 4 or not all(_is_short_label(ln) for ln in row):
        return []
    return sorted(row, key=lambda ln: ln.box[0])


def _is_short_label(line: OcrLine) -> bool:
    text = clean(line.text)
    return 0 < len(text) <= SHORT_BUTTON_CHARS and len(text.split()) <= 2 and not TIME_TEXT.search(text) \
        and not text.replace(".", "").isdigit()


def _is_day_word(text: str) -> bool:
    return bool(re.fullmatch(r"(?i)(yesterday|today|mon|tue|wed|thu|fri|sat|sun)\w*|昨天|今天|周[一二三四五六日]", text))
