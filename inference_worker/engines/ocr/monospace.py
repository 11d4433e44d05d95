"""Whether a window's text sits on a monospace grid (a terminal, a code editor), from its OCR boxes and their pixels.

In a monospace font every character takes one cell of the same width, so two things hold that proportional
text (a document, a dialog) does not show:
- a line's box width grows by one cell per character: across lines, width = cell x characters + a constant
  (the detector's margin). The slope of that fit over pairs of lines estimates the cell width, even when the
  recogniser drops a space or misreads a glyph;
- the cells of every line start on one lattice: the left margin plus multiples of the cell width (an indented
  line starts a whole number of cells in). Glyphs do not fill their cell (side bearings), so the lattice columns
  are blank in every line, while half or more of the columns in a line of text hold ink.
The measure searches cell widths around the fitted one and lattice phases for the one whose columns hold the least
ink, and compares that with the ink of all columns: ~0.0-0.06 of it for terminals (TrueType and bitmap fonts, 8 to
14 px cells), 0.7-0.9 for proportional fonts, whose glyph edges fall anywhere. It reads pixels, so a misread line
still counts; lines with CJK text (full-width glyphs, a grid in any font) and lines without letters (tabular
digits are monospaced in most fonts) are left out.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from inference_worker.engines.ocr.concepts import clean
from inference_worker.engines.ocr.reader import OcrLine

MIN_GRID_LINES = 3             # lines of text the measure needs
MIN_CHARS = 4                  # a line shorter than this says little about its width per character
MIN_FIT_SCORE = 0.9            # lines read less surely than this do not fit the cell width (their count is off)
MIN_LATTICE_SAMPLES = 80       # lattice columns x lines covering them: fewer cannot tell a grid from chance
MAX_LATTICE_INK = 0.25         # monospace: lattice columns hold at most this share of the ink a text column holds
MIN_PROPORTIONAL_INK = 0.5     # proportional: even the emptiest lattice holds at least this share
INK_STEP = 80                  # a pixel this far (0-255, any channel) from its line's background is ink
PITCH_STEP_PX = 0.05           # cell widths tried (fractional: not every toolkit rounds its cells to pixels)
PHASE_STEP_PX = 0.25
_CJK = re.compile(r"[\u3000-\u9fff\uac00-\ud7af\uf900-\ufaff\uff00-\uffef]")
_LETTERS = re.compile(r"[A-Za-z]")


@dataclass(frozen=True)
class Grid:
    cell_px: float             # the cell width
    left_px: float             # the lattice's origin: the left margin (frame x)
    lattice_ink: float         # ink share of the lattice columns relative to all text columns (0 = blank)


def monospace_grid(lines: Sequence[OcrLine], bgr: np.ndarray) -> Grid | None:
    """The grid the lines' characters sit on, or None when they are not monospace (or too few to tell)."""
    grid = emptiest_lattice(lines, bgr)
    return grid if grid is not None and grid.lattice_ink <= MAX_LATTICE_INK else None


def is_proportional(lines: Sequence[OcrLine], bgr: np.ndarray) -> bool:
    """Whether the lines are surely not monospace: even their emptiest lattice holds much of a text column's ink."""
    grid = emptiest_lattice(lines, bgr)
    return grid is not None and grid.lattice_ink >= MIN_PROPORTIONAL_INK


def emptiest_lattice(lines: Sequence[OcrLine], bgr: np.ndarray) -> Grid | None:
    """The lattice near the lines' fitted cell width whose columns hold the least ink (None: too few lines)."""
    sample = [ln for ln in lines if _counts(ln)]
    if len(sample) < MIN_GRID_LINES:
        return None
    cell = fitted_cell_px(sample)
    if cell is None or cell < 3:
        return None
    left, right = min(ln.box[0] for ln in sample), max(ln.box[2] for ln in sample)
    covered, inked = _column_ink(sample, bgr, left, right)
    if not covered.any() or not inked.any():
        return None
    best = _emptiest_lattice(covered, inked, cell)
    if best is None:
        return None
    ink, pitch, phase = best
    return Grid(round(pitch, 2), left + phase, round(float(ink * covered.sum() / inked.sum()), 3))


def fitted_cell_px(lines: Sequence[OcrLine]) -> float | None:
    """Width per character from the lines' box widths: the median slope over pairs of surely read lines whose
    lengths differ by 4 or more characters (a robust fit of width = cell x characters + margin)."""
    sized = [(ln.box[2] - ln.box[0], len(clean(ln.text))) for ln in lines if ln.score >= MIN_FIT_SCORE]
    slopes = [(wb - wa) / (nb - na) for i, (wa, na) in enumerate(sized) for wb, nb in sized[i + 1:]
              if abs(nb - na) >= 4]
    return statistics.median(slopes) if len(slopes) >= 3 else None


def _counts(line: OcrLine) -> bool:
    text = clean(line.text)
    return len(text) >= MIN_CHARS and not _CJK.search(text) and len(_LETTERS.findall(text)) >= 2


def _column_ink(lines: Sequence[OcrLine], bgr: np.ndarray, left: int, right: int) -> tuple[np.ndarray, np.ndarray]:
    """Per frame column in [left, right): how many lines cover it, and in how many of those it holds ink."""
    covered = np.zeros(max(0, right - left), np.int32)
    inked = np.zeros_like(covered)
    height, width = bgr.shape[:2]
    for line in lines:
        x0, top = max(line.box[0], 0), max(line.box[1], 0)
        x1, bottom = min(line.box[2], width), min(line.box[3], height)
        crop = bgr[top:bottom, x0:x1].astype(np.int16)
        if crop.shape[0] < 3 or crop.shape[1] < 3:
            continue
        background = np.median(np.concatenate([crop[0], crop[-1]]), axis=0)
        ink = (np.abs(crop - background).max(axis=2) > INK_STEP).any(axis=0)
        covered[x0 - left:x1 - left] += 1
        inked[x0 - left:x1 - left] += ink
    return covered, inked


def _emptiest_lattice(covered: np.ndarray, inked: np.ndarray, cell_px: float) -> tuple[float, float, float] | None:
    """(ink share, pitch, phase) of the lattice with the least ink, pitches within 30% of `cell_px` (the fit is
    rough when many lines are misread; the range keeps out half pitches), or None when none is sampled enough."""
    best = None
    for pitch in np.arange(0.7 * cell_px, 1.3 * cell_px, PITCH_STEP_PX):
        phases = np.arange(0.0, pitch, PHASE_STEP_PX)
        steps = np.arange(0, len(covered) / pitch + 1)
        columns = np.rint(phases[:, None] + steps[None, :] * pitch).astype(np.int64)
        inside = columns < len(covered)
        columns = np.where(inside, columns, 0)
        samples = np.where(inside, covered[columns], 0).sum(axis=1)
        ink = np.where(inside, inked[columns], 0).sum(axis=1) / np.maximum(1, samples)
        ink[samples < MIN_LATTICE_SAMPLES] = np.inf
        i = int(np.argmin(ink))
        if np.isfinite(ink[i]) and (best is None or ink[i] < best[0]):
            best = (float(ink[i]), float(pitch), float(phases[i]))
    return best
