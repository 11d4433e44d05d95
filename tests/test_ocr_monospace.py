"""The monospace grid measure on text rendered with real fonts (no X needed): DejaVu Sans Mono at several sizes,
light and dark, gives its own advance width as the cell and the margin as the lattice's origin; DejaVu Sans
(proportional) with the same lines has no grid. The lines are read by the real OCR reader, so the boxes are the
detector's, misreads included."""

from __future__ import annotations

from pathlib import Path

import pytest

from inference_worker.engines.ocr.monospace import is_proportional, monospace_grid
from inference_worker.engines.ocr.reader import OcrReader, to_bgr

MONO = Path("/usr/share/fonts/truetype/dejavu/DejaVuSansMono.ttf")
SANS = Path("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")
ROWS = ["$ ls -l", "total 12", "-rw-r--r-- 1 ana ana  812 Mar  3 09:14 notes.txt",
        "drwxr-xr-x 2 ana ana 4096 Mar  3 09:10 photos", "$ grep -n milk todo.txt", "1:buy milk and bread",
        "    indented by four cells", "$ echo done"]


@pytest.fixture(scope="module")
def reader():
    reader = OcrReader()
    yield reader
    reader.close()


def render(font_path: Path, size_px: int, *, dark: bool, left_px: int = 14):
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.truetype(str(font_path), size_px)
    pitch = round(size_px * 1.5)
    image = Image.new("RGB", (800, 40 + pitch * len(ROWS)), "black" if dark else "white")
    draw = ImageDraw.Draw(image)
    for i, row in enumerate(ROWS):
        draw.text((left_px, 20 + i * pitch), row, font=font, fill="#e0e0e0" if dark else "black")
    return image, font


@pytest.mark.parametrize("dark", [False, True], ids=["light", "dark"])
@pytest.mark.parametrize("size_px", [12, 16, 20])
def test_monospace_text_has_its_fonts_advance_as_the_cell(reader, size_px, dark):
    image, font = render(MONO, size_px, dark=dark)
    lines = reader.read_full(image).lines
    grid = monospace_grid(lines, to_bgr(image))
    assert grid is not None, [ln.text for ln in lines]
    advance_px = font.getlength("M")                              # every glyph's advance in a monospace font
    assert abs(grid.cell_px - advance_px) <= 0.1, (grid, advance_px)
    offset_cells = (grid.left_px - 14) / advance_px               # the lattice starts at the margin, to a cell
    assert abs(offset_cells - round(offset_cells)) <= 0.35 and abs(offset_cells) < 1.5, grid
    assert not is_proportional(lines, to_bgr(image))


@pytest.mark.parametrize("dark", [False, True], ids=["light", "dark"])
@pytest.mark.parametrize("size_px", [12, 16, 20])
def test_proportional_text_has_no_grid(reader, size_px, dark):
    image, _ = render(SANS, size_px, dark=dark)
    lines = reader.read_full(image).lines
    assert len(lines) >= 6, [ln.text for ln in lines]
    assert monospace_grid(lines, to_bgr(image)) is None, [ln.text for ln in lines]
    assert is_proportional(lines, to_bgr(image))


def test_too_few_lines_say_nothing(reader):
    from PIL import Image, ImageDraw, ImageFont

    image = Image.new("RGB", (400, 60), "white")
    ImageDraw.Draw(image).text((10, 15), "$ ls -l notes.txt", font=ImageFont.truetype(str(MONO), 16), fill="black")
    lines = reader.read_full(image).lines
    assert monospace_grid(lines, to_bgr(image)) is None and not is_proportional(lines, to_bgr(image))
