"""Every glyph the pixels show is in the text read: a line that lost one is read again with more frames per glyph.

PP-OCRv4's recogniser reads a line as a row of frames, one per 8 px of its input's width, and CTC decoding merges a
character seen on neighbouring frames into one unless a blank frame lies between them. At the height the reader
recognises at (36 px, for speed) a small font gets about two frames per glyph, too few for that blank: "22000" came
out "2000", "11000" "1000", "33,000" "3", with scores (0.65-0.87) that pass the reader's bar, so nothing downstream
could tell (gnumeric's cells in Noto Sans CJK digits under a Chinese locale; DejaVu Sans 9-12 px; "will" read "wil").

So a reading is checked against its crop's pixels: on a line of Latin script the glyphs are separated by columns
without ink, and when the text read has fewer characters than the crop shows glyphs, the crop is read again at the
recogniser's own training height with its width stretched to give each glyph enough frames. The second reading is
kept when it accounts for the glyphs better. CJK characters are built of several separate strokes, so lines with CJK
text are not counted this way (their digits are: a cell's number is its own line). The check costs a few numpy
passes over the crop; the second read happens only for the lines that need it (51 of ~880 lines on 28 screens of
gnumeric, mousepad, xedit and zenity: +7-10% CPU for a full read without the reader's cache; a line that did not
change is not recognised again at all).
"""

from __future__ import annotations

import math
import re

import numpy as np

#: the recogniser's own input height (PP-OCRv4 was trained at 48 px)
TRAINED_HEIGHT_PX = 48
#: input pixels per output frame of the recogniser
PX_PER_FRAME = 8
#: frames per glyph the second reading gets: a repeated glyph then has room for the blank between its copies (4 made
#: the gaps between words too wide to read as spaces: "UseControl-SandControl-R")
FRAMES_PER_GLYPH = 3
MAX_STRETCH = 3.0
#: a column holds ink where a pixel differs from the background by this share of the crop's strongest contrast
INK_SHARE = 0.5
#: below this contrast (0-255) the crop holds no text to count
MIN_CONTRAST = 40
#: the rows counted: the middle of the crop (an underline or a cell border along its top or bottom would join every
#: column into one)
BAND = (0.15, 0.85)
_NOT_COUNTED = re.compile(r"[\u3040-\u30ff\u3400-\u9fff\uac00-\ud7af\uf900-\ufaff]")


def glyph_count(crop: np.ndarray) -> int:
    """How many glyphs a line's crop (HxWx3 uint8) shows: runs of columns with ink, separated by columns without."""
    if crop.size == 0:
        return 0
    pixels = crop.astype(np.int16)
    border = np.concatenate([pixels[0], pixels[-1], pixels[:, 0], pixels[:, -1]])
    contrast = np.abs(pixels - np.median(border, axis=0)).max(axis=2)
    strongest = int(contrast.max())
    if strongest < MIN_CONTRAST:
        return 0
    height = contrast.shape[0]
    top, bottom = int(height * BAND[0]), max(int(height * BAND[0]) + 1, int(height * BAND[1]))
    ink = (contrast[top:bottom] >= INK_SHARE * strongest).any(axis=0)
    return int(np.count_nonzero(ink[1:] & ~ink[:-1]) + bool(ink[0]))


def lost_glyphs(text: str, glyphs: int) -> bool:
    """Whether a reading of a crop showing `glyphs` glyphs left some out (CJK lines are not counted: see above; a
    crop the recogniser read nothing in holds no text, an icon most often)."""
    return bool(text) and not _NOT_COUNTED.search(text) and _num_chars(text) < glyphs


def stretch_for(glyphs: int, crop_shape: tuple[int, ...]) -> float:
    """How much wider than its aspect the crop is read at TRAINED_HEIGHT_PX for FRAMES_PER_GLYPH frames a glyph."""
    height, width = crop_shape[:2]
    frames = TRAINED_HEIGHT_PX * width / max(1, height) / PX_PER_FRAME
    return min(MAX_STRETCH, max(1.0, math.ceil(FRAMES_PER_GLYPH * glyphs / max(1.0, frames) * 4) / 4))


def better_reading(first: tuple[str, float], second: tuple[str, float], glyphs: int) -> tuple[str, float]:
    """The reading whose characters account for the crop's glyphs more closely (the first on a tie)."""
    if abs(glyphs - _num_chars(second[0])) < abs(glyphs - _num_chars(first[0])):
        return second
    return first


def _num_chars(text: str) -> int:
    return len("".join(text.split()))
