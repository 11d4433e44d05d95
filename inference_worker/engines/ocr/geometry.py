"""Measures of how the read lines lie in a window: rows, columns of aligned cells, a sheet's column letters and
row numbers, captions with an input box beside them, light text on a dark background. Pure functions of the lines'
boxes and the frame's pixels; `layout` combines them into a window's kind.
"""

from __future__ import annotations

import re
from typing import Sequence

import numpy as np

from inference_worker.engines.ocr.concepts import clean
from inference_worker.engines.ocr.reader import OcrLine
from inference_worker.engines.ocr.windows import WindowView


def is_label(line: OcrLine, lines: Sequence[OcrLine], view: WindowView) -> bool:
    """A short caption with nothing read to its right on its row. A line that runs into a window in front is cut
    off there, not short: what follows it is hidden."""
    text = clean(line.text)
    if not 2 <= len(text) <= 24 or len(text.split()) > 3 or re.fullmatch(r"[\d\s:/.-]+", text):
        return False
    if view.is_covered(line.box[2] + line.height, line.center[1]):
        return False
    return not any(o is not line and abs(o.center[1] - line.center[1]) < line.height / 2 and o.box[0] > line.box[2]
                   for o in lines)


def field_right_of(line: OcrLine, bgr: np.ndarray, view: WindowView) -> bool:
    """An input box right of a label: at several columns, a drawn edge just above and just below the label's row
    (in the label's own window: the edges of a window in front are not its fields)."""
    height = bgr.shape[0]
    y = int(line.center[1])
    reach = int(line.height * 0.5 + 14)
    found = 0
    for dx in (30, 70, 110):
        x = line.box[2] + dx
        if x >= min(view.box[2], bgr.shape[1]) or view.is_covered(x, y):
            break
        column = bgr[max(0, y - reach):min(height, y + reach), x].astype(int)
        steps = np.abs(np.diff(column, axis=0)).max(axis=1)
        above, below = steps[:len(steps) // 2], steps[len(steps) // 2:]
        if above.size and below.size and above.max() > 24 and below.max() > 24:
            found += 1
    return found >= 2


def grid_columns(lines: Sequence[OcrLine], *, min_rows: int, numeric: bool) -> int:
    """How many columns of cells line up (left or right edges within a few px) over `min_rows` rows or more;
    with `numeric`, only columns whose cells are mostly numbers count."""
    cells = [ln for ln in lines if len(clean(ln.text)) <= 40]
    if numeric:
        cells = [ln for ln in cells if _is_number(clean(ln.text))]
    counts = []
    for edge in (0, 2):                       # left-aligned (text) or right-aligned (numbers) columns
        groups = _edge_groups(cells, edge)
        counts.append(sum(1 for g in groups if len(clusters([ln.center[1] for ln in g], tolerance=4)) >= min_rows))
    return max(counts)


def _edge_groups(cells: Sequence[OcrLine], edge: int) -> list[list[OcrLine]]:
    groups: list[list[OcrLine]] = []
    for cell in sorted(cells, key=lambda ln: ln.box[edge]):
        if groups and cell.box[edge] - groups[-1][-1].box[edge] <= 6:
            groups[-1].append(cell)
        else:
            groups.append([cell])
    return groups


def has_column_letters(lines: Sequence[OcrLine]) -> bool:
    """A row of 4+ single letters in alphabetical order at a steady pitch (A B C D ..., some may be hidden
    behind another window: the pitch per letter still holds)."""
    letters = [ln for ln in lines if re.fullmatch(r"[A-Za-z]", clean(ln.text))]
    for row in rows_of(letters):
        row = sorted(row, key=lambda ln: ln.box[0])
        codes = [ord(clean(ln.text).upper()) for ln in row]
        for start in range(len(row)):
            if _steady_letters(row[start:], codes[start:]) >= 4:
                return True
    return False


def _steady_letters(row: Sequence[OcrLine], codes: Sequence[int]) -> int:
    """How many of the letters, from the first, go up the alphabet at one x pitch per letter (within 20%)."""
    count, pitch = 1, None
    for i in range(1, len(row)):
        step = codes[i] - codes[i - 1]
        if step <= 0:
            break
        per_letter = (row[i].center[0] - row[i - 1].center[0]) / step
        if pitch is None:
            pitch = per_letter
        elif not 0.8 * pitch <= per_letter <= 1.2 * pitch:
            break
        count += 1
    return count


def has_row_numbers(lines: Sequence[OcrLine]) -> bool:
    numbers = [ln for ln in lines if re.fullmatch(r"\d{1,4}", clean(ln.text))]
    for column in _edge_groups(numbers, 2):
        values = [int(clean(ln.text)) for ln in sorted(column, key=lambda ln: ln.center[1])]
        if max((_run_length(values[i:]) for i in range(len(values))), default=0) >= 5:
            return True
    return False


def _run_length(values: Sequence[int]) -> int:
    """How many values from the first go up by one each."""
    length = 1 if values else 0
    while length < len(values) and values[length] == values[length - 1] + 1:
        length += 1
    return length


def rows_of(lines: Sequence[OcrLine]) -> list[list[OcrLine]]:
    """Lines grouped into rows (vertical centres within half a line height), top to bottom."""
    rows: list[list[OcrLine]] = []
    for line in sorted(lines, key=lambda ln: ln.center[1]):
        if rows and abs(line.center[1] - rows[-1][0].center[1]) <= max(4, line.height / 2):
            rows[-1].append(line)
        else:
            rows.append([line])
    return rows


def clusters(values: Sequence[float], tolerance: float) -> list[int]:
    """Sizes of groups of values that lie within `tolerance` of their neighbour ([0] when there are none)."""
    sizes: list[int] = []
    last = None
    for value in sorted(values):
        if last is not None and value - last <= tolerance:
            sizes[-1] += 1
        else:
            sizes.append(1)
        last = value
    return sizes or [0]


def _is_number(text: str) -> bool:
    return bool(re.fullmatch(r"[-+(]?[$€£¥]?\d[\d,. ]*%?\)?", text))

def is_dark_behind_text(bgr: np.ndarray, lines: Sequence[OcrLine]) -> bool:
    """Whether most of the text is light on dark: the lines' boxes' edges (their background) are dark."""
    dark = 0
    for line in lines:
        left, top, right, bottom = line.box
        edges = np.concatenate([bgr[top, left:right], bgr[min(bottom, bgr.shape[0]) - 1, left:right]])
        dark += edges.size > 0 and float(np.median(edges.mean(axis=1))) < 80
    return dark >= 0.6 * len(lines)
