"""One description of a screen made of windows: the foreground window first, with its real title and its kind,
then the other visible windows; faithful text only (fragments and misread symbols dropped).

The kind of each window comes from its layout (`layout.classify`); the words (`concepts`) may refine it — a
dialog that speaks of a meeting starting is a calendar reminder, a terminal showing a traceback is a Python
traceback — but never contradict it: a word inside a document does not make it a dialog or a sign-in form.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from inference_worker.engines.ocr.concepts import (ENTITY_KINDS, ConceptMatch, Entity, ScreenDescription, bounded,
                                                   clean, compose_summary, describe, extract_entities,
                                                   match_concepts, salient_order, title_index)
from inference_worker.engines.ocr.geometry import rows_of
from inference_worker.engines.ocr.layout import Kind, button_row, classify
from inference_worker.engines.ocr.reader import OcrLine
from inference_worker.engines.ocr.windows import WindowView
from inference_worker.protocol import MAX_KEY_OBJECTS, OBJECT_MAX_CHARS, SUMMARY_MAX_CHARS

#: concepts only a layout can establish: their words alone ("错误", "password") do not make the window one
LAYOUT_ONLY = frozenset({"error dialog", "warning dialog", "dialog", "login form", "terminal", "code editor",
                         "spreadsheet", "table", "error", "warning"})
#: content concepts that name a window more precisely than its layout kind does
REFINES = {
    "terminal": {"python traceback"},
    "dialog": {"meeting reminder", "low battery", "update", "download", "notification"},
    "error dialog": {"python traceback"},
    "form": {"login form", "shopping", "settings"},
    "list": {"email inbox", "chat", "file manager", "search results", "calendar", "notification", "media player"},
    "email inbox": {"email inbox"},
    "document": set(),
}
_CJK = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]")
MIN_FRAGMENT_SCORE = 0.75          # short fragments (<= 3 characters) read with less confidence are dropped
MAX_SYMBOL_INK_FRACTION = 0.5      # letters fill most of a line's height; ~~^~~ and ---- do not


@dataclass(frozen=True)
class ToldWindow:
    view: WindowView
    kind: Kind | None
    described: ScreenDescription
    lines: list[OcrLine]             # the faithful lines, reading order
    quotes: list[str]                # what is worth quoting, best first

    @property
    def heading(self) -> str:
        return self.described.kind


def describe_screen(views: Sequence[WindowView], bgr: np.ndarray, frame_height: int) -> ScreenDescription:
    """The whole screen's description: windows in `views` order (foreground first)."""
    told = [tell(view, bgr, frame_height) for view in views]
    told = [t for t in told if t.lines or t.view.title]
    if not told:
        return describe([], frame_height)
    if len(told) == 1 and told[0].view.source == "screen":
        return told[0].described
    sections = []
    for number, window in enumerate(told):
        name = window.heading if number == 0 else window.heading[0].lower() + window.heading[1:]
        title = f" “{bounded(clean(window.view.title), 60)}”" if window.view.title else ""
        lead = f"{name}{title}: " if number == 0 else f". Behind it, {name}{title}: "
        if number and window.view.source == "screen":
            lead = ". Also on screen: "
        sections.append((lead, window.quotes))
    summary, _ = compose_summary(sections, SUMMARY_MAX_CHARS)
    if not told[0].quotes and told[0].view.title:
        summary = summary.rstrip(": ")
    objects = _objects(told)
    first = told[0].described
    return ScreenDescription(summary, objects, first.kind, first.matches, first.entities, first.quoted)


def tell(view: WindowView, bgr: np.ndarray, frame_height: int) -> ToldWindow:
    lines = faithful_lines(view.lines, bgr)
    kind = classify(replace(view, lines=lines), bgr)
    described, quotes = describe_window(lines, kind, view.title, frame_height)
    return ToldWindow(view, kind, described, lines, quotes)


def describe_window(lines: Sequence[OcrLine], kind: Kind | None, title: str | None,
                    frame_height: int) -> tuple[ScreenDescription, list[str]]:
    """Kind from the layout, refined (never contradicted) by the words; the title's own line not quoted again.
    Returns the description and the texts worth quoting, best first (a table's rows, a dialog's message then
    its buttons, else the salient lines)."""
    texts = [clean(line.text) for line in lines]
    words = list(texts) + ([clean(title)] if title else [])
    matches = _allowed(match_concepts(words), kind)
    entities = extract_entities(texts)
    refined = next((m for m in matches if m.names_screen and kind is not None
                    and m.concept.label in _refinements(kind)), None)
    if kind is not None:
        heading = refined.concept.screen if refined else kind.screen
        labels = ([refined.concept.label] if refined else []) + [kind.label]
    else:
        best = next((m for m in matches if m.names_screen), None)
        heading = best.concept.screen if best else ("A window" if title else "Text on screen")
        labels = []
    labels += [m.concept.label for i, m in enumerate(matches)
               if (i == 0 or m.is_sure) and m.concept.label not in labels]
    order = salient_order(lines, texts, matches, entities, frame_height, title_first=not title)
    if title:
        order = [i for i in order if texts[i].replace(" ", "") != clean(title).replace(" ", "")]
    quotes = _kind_quotes(lines, kind, title, frame_height) or [texts[i] for i in order]
    summary, (quoted,) = compose_summary([(f"{heading}: ", quotes)])
    objects = _unique(labels[:4] + [e.key_object for e in _by_turns(entities)])
    described = ScreenDescription(summary, objects, heading, matches, entities,
                                  [order[i] for i in quoted if i < len(order)])
    return described, [quotes[i] for i in quoted] + [q for i, q in enumerate(quotes) if i not in quoted]


def _kind_quotes(lines: Sequence[OcrLine], kind: Kind | None, title: str | None, frame_height: int) -> list[str]:
    """How a kind is best quoted: a table by its rows of cells (headers and row numbers left out), a dialog by
    its message top to bottom (its title-like line first when the window's title is unknown) and then its
    buttons; [] = by salience."""
    if kind is None:
        return []
    if kind.label in ("spreadsheet", "table", "list", "email inbox"):
        rows = []
        for row in rows_of(lines):
            cells = [clean(ln.text) for ln in sorted(row, key=lambda ln: ln.box[0])]
            if kind.label == "spreadsheet":
                if all(re.fullmatch(r"[A-Z]{1,2}", c) for c in cells):
                    continue                                   # the column letters
                if len(cells) >= 2 and re.fullmatch(r"\d{1,5}", cells[0]):
                    cells = cells[1:]                          # the row number
            if len(cells) >= 2 or (cells and len(cells[0].split()) >= 3):
                figures = sum(1 for c in cells if re.fullmatch(r"[-+(]?[$€£¥]?\d[\d,. ]*%?\)?", c))
                rows.append((" ".join(cells), figures / len(cells)))
        if kind.label in ("spreadsheet", "table"):        # rows mostly of figures before menus and toolbars
            rows.sort(key=lambda row: row[1] < 0.5)
        return [text for text, _ in rows]
    if kind.label.endswith("dialog"):
        buttons = button_row(lines)
        message = [ln for ln in lines if ln not in buttons]
        heading = None if title else title_index(message, [clean(ln.text) for ln in message], frame_height)
        first = [message[heading]] if heading is not None else []
        return [clean(ln.text) for ln in first + [ln for ln in message if ln not in first] + buttons]
    return []


# -------------------------------------------------------------------- faithful text

def faithful_lines(lines: Sequence[OcrLine], bgr: np.ndarray) -> list[OcrLine]:
    """Lines worth quoting: not unsure short fragments, not symbol rows misread as letters (~~^~~ as "NNAN"),
    not a lone CJK character in a window with no other CJK text (a toolbar icon read as 田)."""
    kept = [line for line in lines if _is_faithful(line, bgr)]
    has_cjk_text = any(len(_CJK.findall(line.text)) >= 2 for line in kept)
    return [line for line in kept if has_cjk_text or not _CJK.search(line.text) or len(clean(line.text)) > 2]


def _is_faithful(line: OcrLine, bgr: np.ndarray) -> bool:
    text = clean(line.text)
    if not re.search(r"[\w\u3400-\u9fff]", text) and not re.fullmatch(r"[+\-×÷*/=%]|\+/-", text):
        return False                                  # punctuation only: underlines, rules, caret markers
    if len(text) <= 3 and line.score < MIN_FRAGMENT_SCORE:
        return False
    if re.fullmatch(r"[A-Z]{3,}", text) and len(set(text)) <= 3 and _ink_fraction(line, bgr) < MAX_SYMBOL_INK_FRACTION:
        return False                                  # a row of ~ ^ - = read as capitals
    return True


def _ink_fraction(line: OcrLine, bgr: np.ndarray) -> float:
    """The share of the line box's rows that hold ink (pixels far from the box's border colour)."""
    left, top, right, bottom = line.box
    crop = bgr[max(0, top):bottom, max(0, left):right].astype(int)
    if crop.size == 0:
        return 1.0
    border = np.concatenate([crop[0], crop[-1]])
    background = np.median(border, axis=0)
    ink_rows = (np.abs(crop - background).max(axis=2) > 80).any(axis=1)
    return float(ink_rows.mean())


# -------------------------------------------------------------------- key objects

def _allowed(matches: Sequence[ConceptMatch], kind: Kind | None) -> list[ConceptMatch]:
    """Concepts the words may claim: layout-only ones only when the layout found that kind (or refines it), and
    those that need a layout (Concept.layout) only in it, even when the layout says nothing."""
    found = kind.label if kind is not None else None
    matches = [m for m in matches if m.concept.layout in (None, found)]
    if kind is None:
        return list(matches)                          # the layout says nothing: the words do their best
    allowed = _refinements(kind) | {kind.label}
    if kind.label == "dialog":
        allowed |= {"error dialog", "warning dialog", "error", "warning"}
    return [m for m in matches if m.concept.label not in LAYOUT_ONLY or m.concept.label in allowed]


def _refinements(kind: Kind) -> set[str]:
    """Content concepts that may name a window of this kind more precisely (a dialog's flavours share them)."""
    refines = set(REFINES.get(kind.label, ()))
    if kind.label.endswith("dialog"):
        refines |= REFINES["dialog"]
    return refines


def _objects(told: Sequence[ToldWindow]) -> list[str]:
    """The foreground window's objects first; then the other windows' kinds and their error names/sources."""
    objects = list(told[0].described.key_objects)
    for window in told[1:]:
        extra = [o for o in window.described.key_objects[:3]]
        objects += extra
    return _unique(objects)[:MAX_KEY_OBJECTS]


def _by_turns(entities: Sequence[Entity]) -> list[Entity]:
    by_kind = [[e for e in entities if e.kind == kind.name] for kind in ENTITY_KINDS]
    return [group[i] for i in range(max(map(len, by_kind), default=0)) for group in by_kind if i < len(group)]


def _unique(items: Sequence[str]) -> list[str]:
    seen: list[str] = []
    for item in items:
        item = bounded(clean(item), OBJECT_MAX_CHARS)
        if item and item not in seen:
            seen.append(item)
    return seen[:MAX_KEY_OBJECTS]
