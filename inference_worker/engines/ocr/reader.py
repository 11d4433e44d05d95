"""Read the text on a screen frame with RapidOCR, re-reading only the parts that changed.

The models are the PP-OCRv4 detector and recogniser shipped inside the rapidocr-onnxruntime wheel
(models.py): nothing is downloaded, ever. They load on the first read (or `load`), not at import. The reader keeps the
previous frame and its lines; when a new frame of the same size differs only in a few regions, only
those regions are detected and recognised again and every other line is kept.

That memory (previous frame, its lines, recognised crops) is state, so reads take turns (one lock): a read diffs
against the frame last read and keeps that frame's lines only, whatever thread reads (the OCR-grounded engine reads
on several preprocessing threads). Two full reads of 1600 px text frames on 2 cores: 1.28 s in turn on one reader,
1.71 s side by side on two (each read runs its own threads), and a second reader holds +192 MiB of models.
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from inference_worker.engines.ocr.glyphs import (TRAINED_HEIGHT_PX, better_reading, glyph_count, lost_glyphs,
                                                 stretch_for)
from inference_worker.engines.ocr.models import (DET_STRIDE, Models, detect_quads, load_models, pad_for_detector,
                                                 rec_input, resolved_threads)
from inference_worker.engines.ocr.regions import (OcrLine, Rect, changed_regions, contains, frame_diff, grow, quad_center,
                                                  quad_rect, whole)

if TYPE_CHECKING:
    from PIL.Image import Image



@dataclass(frozen=True)
class OcrConfig:
    #: frames wider or taller than this are scaled down for detection only (recognition reads full pixels);
    #: 960 halves a full-HD frame and its boxes get too loose for 36 px recognition (benchmarks/ocr_latency.py)
    det_max_side_px: int = 1280
    #: line crops are scaled to this height for recognition; the model was trained at 48 px, and 36 px
    #: reads screen text as well (see benchmarks/ocr_latency.py) for ~45% less recognition time, except that a small
    #: font's repeated glyphs can merge there ("22000" -> "2000"): such a line is read again (glyphs.py)
    rec_height_px: int = 36
    #: lines recognised with a lower mean confidence are dropped
    min_score: float = 0.5
    #: CPU threads for one read; 0 = one per CPU. Detection (one large image) runs with this many onnxruntime
    #: intra-op threads; recognition (many small crops, which split badly across threads: 2 threads cost 36% more
    #: CPU for 7% less wall time) runs this many crops at once, one thread each (benchmarks/ocr_latency.py)
    num_threads: int = 2
    #: a pixel whose channel value moved by more than this (0-255) counts as changed
    diff_threshold: int = 24
    #: context kept around a changed region when it is re-read
    margin_px: int = 12
    #: when the changed regions cover more than this fraction of the frame, read the whole frame
    max_reread_fraction: float = 0.5
    #: recognised crops remembered by their pixels: a line that did not change is not recognised again,
    #: even when the frame around it did (a dialog opened, the window moved); 0 = no cache
    max_rec_cache_entries: int = 2048
    #: run the detector and the recogniser with their per-pixel affine and hard-swish passes folded into their
    #: convolutions (folding.py: same texts and boxes, ~25% less CPU); off = the wheel's models as shipped
    simplify_models: bool = True
    #: when the models are loaded ahead of the first read (the worker's "loading" state), read a synthetic frame
    #: of this size (width, height) twice, so that onnxruntime's first-run work (its memory arena and per-shape
    #: memory plans) and lazy imports happen then, not on the user's first reads; (0, 0) = no warm-up
    warm_up_frame_px: tuple[int, int] = (800, 600)

    def __post_init__(self):
        if not 64 <= self.det_max_side_px <= 4096:
            raise ValueError(f"det_max_side_px must be 64..4096; got {self.det_max_side_px}.")
        if not 16 <= self.rec_height_px <= 64:
            raise ValueError(f"rec_height_px must be 16..64 (the model reads 48); got {self.rec_height_px}.")
        if not 0.0 <= self.min_score < 1.0:
            raise ValueError(f"min_score must be in [0, 1); got {self.min_score}.")
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0 (0 = one per CPU); got {self.num_threads}.")
        if not 0 <= self.diff_threshold <= 255 or self.margin_px < 0:
            raise ValueError("diff_threshold must be 0..255 and margin_px >= 0.")
        if not 0.0 < self.max_reread_fraction <= 1.0:
            raise ValueError(f"max_reread_fraction must be in (0, 1]; got {self.max_reread_fraction}.")
        if not 0 <= self.max_rec_cache_entries <= 100_000:
            raise ValueError(f"max_rec_cache_entries must be 0..100000; got {self.max_rec_cache_entries}.")
        width, height = self.warm_up_frame_px
        if (width, height) != (0, 0) and not (64 <= width <= 4096 and 64 <= height <= 4096):
            raise ValueError(f"warm_up_frame_px must be (0, 0) (no warm-up) or two sides of 64..4096 px; "
                             f"got {self.warm_up_frame_px}.")


@dataclass(frozen=True)
class ReadResult:
    lines: tuple[OcrLine, ...]     # reading order: top to bottom, left to right within a row
    regions: tuple[Rect, ...]      # what was detected and recognised this time (the whole frame on a full read)
    is_full_read: bool
    frame_size: tuple[int, int]    # width, height
    read_s: float

    @property
    def area_read_px(self) -> int:
        return sum((r[2] - r[0]) * (r[3] - r[1]) for r in self.regions)

    @property
    def area_read_fraction(self) -> float:
        width, height = self.frame_size
        return self.area_read_px / max(1, width * height)


class OcrReader:
    """`read(frame)` returns the frame's lines; what did not change since the last frame is not re-read."""

    def __init__(self, config: OcrConfig | None = None):
        self.config = config or OcrConfig()
        self._ocr: Models | None = None           # RapidOCR's detector and recogniser, loaded on first use
        self._rec_pool: ThreadPoolExecutor | None = None    # recognises crops side by side during one read
        self._last_frame: np.ndarray | None = None
        self._last_lines: tuple[OcrLine, ...] = ()
        self._rec_cache: dict[bytes, tuple[str, float]] = {}    # crop pixels' digest -> (text, score)
        self.num_rec_cache_hits = 0
        self.load_s: float | None = None            # how long the last load took, its warm-up reads included
        self.warm_up_result: ReadResult | None = None    # what the last warm-up read (for the engine's warm-up)
        self._lock = threading.RLock()              # one read (or load, reset, close) at a time: see the docstring

    @property
    def is_loaded(self) -> bool:
        return self._ocr is not None

    def load(self, warm_up: bool = True) -> None:
        """Load the detection and recognition models (from the wheel; no network) and, with `warm_up`, read a
        synthetic frame (`OcrConfig.warm_up_frame_px`) twice. Idempotent. A read loads them itself, without the
        warm-up (it is the first read already)."""
        with self._lock:
            self._load(warm_up)

    def _load(self, warm_up: bool) -> None:
        if self._ocr is None:
            started = time.perf_counter()
            self._ocr = load_models(self.config.num_threads, simplify=self.config.simplify_models)
            self._rec_pool = ThreadPoolExecutor(resolved_threads(self.config.num_threads), thread_name_prefix="ocr-rec")
            if warm_up and self.config.warm_up_frame_px != (0, 0):
                self._warm_up(warm_up_frame(*self.config.warm_up_frame_px))
            self.load_s = time.perf_counter() - started

    def _warm_up(self, frame: "Image") -> None:
        """Read `frame` twice. onnxruntime plans a shape's memory on its first run and allocates that plan as one
        block on the second (~70 MB for an 800x600 detection), and the recognition threads set up on first use:
        all of it happens here, so that the first two reads of a frame this size allocate nothing new
        (tests/test_ocr_models.py). The synthetic frame is then forgotten (not the previous frame, not cached)."""
        for _ in range(2):
            self.clear_cache()
            self.warm_up_result = self.read(frame)
        self.clear_cache()
        self.num_rec_cache_hits = 0

    def reset(self) -> None:
        """Forget the previous frame: the next read is a full read."""
        with self._lock:
            self._last_frame, self._last_lines = None, ()

    def clear_cache(self) -> None:
        """Forget recognised crops too: the next read recognises every line (the benchmarks' worst case)."""
        with self._lock:
            self.reset()
            self._rec_cache.clear()

    def close(self) -> None:
        """Forget the previous frame and the cache, and free the models (a later read loads them again)."""
        with self._lock:
            self.clear_cache()
            if self._rec_pool is not None:
                self._rec_pool.shutdown(wait=True, cancel_futures=True)
            self._ocr, self._rec_pool = None, None

    def read(self, frame: "Image | np.ndarray") -> ReadResult:
        """Lines of `frame` (PIL image, or HxWx3 BGR uint8 array), re-reading only what changed. Any thread;
        reads take turns (`read_s` counts this read's own time, not its wait)."""
        with self._lock:
            return self._read(frame)

    def _read(self, frame: "Image | np.ndarray") -> ReadResult:
        started = time.perf_counter()
        bgr = to_bgr(frame)
        regions = self._changed_regions(bgr)
        if regions is None:
            lines, regions, is_full = self._read_regions(bgr, [whole(bgr)]), (whole(bgr),), True
        else:
            kept = [ln for ln in self._last_lines if not any(contains(r, ln.center) for r in regions)]
            lines, is_full = kept + self._read_regions(bgr, regions), False
        self._last_frame, self._last_lines = bgr, tuple(reading_order(lines))
        return ReadResult(self._last_lines, tuple(regions), is_full, (bgr.shape[1], bgr.shape[0]),
                          time.perf_counter() - started)

    def read_full(self, frame: "Image | np.ndarray") -> ReadResult:
        """Read the whole frame, ignoring the previous one (and remember it for the next `read`)."""
        with self._lock:
            self.reset()
            return self.read(frame)

    # ---------------------------------------------------------------- change detection

    def _changed_regions(self, bgr: np.ndarray) -> list[Rect] | None:
        """Regions to re-read, [] when nothing changed, None when a full read is due."""
        prev = self._last_frame
        if prev is None or prev.shape != bgr.shape:
            return None
        diff = frame_diff(prev, bgr)
        regions = changed_regions(diff, self.config.diff_threshold, self._last_lines, self.config.margin_px)
        area = sum((r[2] - r[0]) * (r[3] - r[1]) for r in regions)
        if area > self.config.max_reread_fraction * bgr.shape[0] * bgr.shape[1]:
            return None
        return regions

    # ---------------------------------------------------------------- detection + recognition

    def _read_regions(self, bgr: np.ndarray, regions: list[Rect]) -> list[OcrLine]:
        self._load(warm_up=False)
        small, scale = _fit(bgr, self.config.det_max_side_px)
        lines: list[OcrLine] = []
        for region in regions:
            quads = self._detect(small, scale, grow(region, self.config.margin_px))
            quads = [q for q in quads if contains(region, quad_center(q))]
            lines.extend(self._recognize(bgr, quads))
        return lines

    def _detect(self, small: np.ndarray, scale: float, window: Rect) -> list[np.ndarray]:
        """Text quads (4x2 float32, frame coordinates) found inside `window` (frame coordinates).

        `small` is the whole frame scaled for detection. The window is cut from it on the detector's
        32-pixel grid, so a region re-read sees the very pixels, in the same stride phase, that a full
        read sees. The boxes still differ by a pixel or two (the detector pools over its whole input),
        which recognition at `rec_height_px` shrugs off (tests/test_ocr_engine.py checks the text).
        """
        height, width = small.shape[:2]
        left = max(0, math.floor(window[0] * scale)) // DET_STRIDE * DET_STRIDE
        top = max(0, math.floor(window[1] * scale)) // DET_STRIDE * DET_STRIDE
        right, bottom = min(width, math.ceil(window[2] * scale)), min(height, math.ceil(window[3] * scale))
        quads = detect_quads(self._ocr.text_det, pad_for_detector(small[top:bottom, left:right]))
        if quads is None or len(quads) == 0:
            return []
        result = []
        for quad in quads:
            quad = ((quad.astype(np.float64) + (left, top)) / scale).astype(np.float32)
            quad[:, 0] = np.clip(quad[:, 0], 0, width / scale - 1)
            quad[:, 1] = np.clip(quad[:, 1], 0, height / scale - 1)
            result.append(quad)
        return result

    def _recognize(self, bgr: np.ndarray, quads: list[np.ndarray]) -> list[OcrLine]:
        """Recognise the quads' crops; a crop seen before (the same pixels) comes from the cache. The others run
        side by side on the reader's threads, widest first (so that no long line is left for last); each call
        returns before `read` does, so the model is only ever in use during a read."""
        if not quads:
            return []
        rects = [quad_rect(quad) for quad in quads]
        keys = [_text_key(bgr, rect) for rect in rects]
        known = {key: self._rec_cache[key] for key in keys if key in self._rec_cache}
        todo: dict[bytes, int] = {}                   # key -> the first crop with it: a repeated crop is read once
        for i, key in enumerate(keys):
            if key not in known:
                todo.setdefault(key, i)
        self.num_rec_cache_hits += len(keys) - len(todo)
        widest_first = sorted(todo.items(), key=lambda item: rects[item[1]][0] - rects[item[1]][2])
        for (key, _), result in zip(widest_first, self._rec_pool.map(lambda item: self._recognize_one(
                bgr, quads[item[1]]), widest_first)):
            known[key] = result
            self._remember(key, result)
        lines = []
        for key, rect in zip(keys, rects):
            text, score = known[key]
            if text and score >= self.config.min_score:
                lines.append(OcrLine(text, rect, score))
        return lines

    def _recognize_one(self, bgr: np.ndarray, quad: np.ndarray) -> tuple[str, float]:
        """(text, mean confidence) of one quad's crop; runs on a recognition thread (onnxruntime and OpenCV let
        go of the GIL while they compute). A reading that left out glyphs the crop shows is read again with more
        frames per glyph (glyphs.py: "22000" read as "2000")."""
        crop = self._ocr.crop(bgr, quad)
        reading = self._recognize_crop(crop, self.config.rec_height_px)
        glyphs = glyph_count(crop) if reading[0] else 0
        if lost_glyphs(reading[0], glyphs):
            again = self._recognize_crop(crop, TRAINED_HEIGHT_PX, stretch_for(glyphs, crop.shape))
            reading = better_reading(reading, again, glyphs)
        return reading

    def _recognize_crop(self, crop: np.ndarray, height_px: int, stretch: float = 1.0) -> tuple[str, float]:
        text, score = self._ocr.rec_decode(self._ocr.recognize(rec_input(crop, height_px, stretch)))[0][:2]
        return text.strip(), round(float(score), 4)

    def _remember(self, key: bytes, result: tuple[str, float]) -> None:
        self._rec_cache[key] = result
        while len(self._rec_cache) > max(1, self.config.max_rec_cache_entries):
            self._rec_cache.pop(next(iter(self._rec_cache)))            # oldest first


# -------------------------------------------------------------------- pure helpers

#: the warm-up frame's lines: short and long (recognition sizes its buffers by the crop's width), three sizes
WARM_UP_LINES = (("Warm-up frame 0123456789", 14), ("The quick brown fox jumps over the lazy dog " * 3, 12),
                 ("File \"/tmp/x.py\", line 4, in <module>  ZeroDivisionError: division by zero", 13),
                 ("Invoice #4411 total $1,249.00", 20), ("OK", 16))


def warm_up_frame(width: int, height: int) -> "Image":
    """A synthetic frame of the given size with a few lines of text (Pillow's built-in font: no font file). The
    detector's work depends on the frame's size only, recognition's on the lines' widths: five lines do."""
    from PIL import Image, ImageDraw, ImageFont

    image = Image.new("RGB", (width, height), (250, 250, 250))
    draw, top = ImageDraw.Draw(image), 8
    for line, size_px in WARM_UP_LINES:
        if top < height - 2 * size_px:
            draw.text((8, top), line, fill=(20, 20, 20), font=ImageFont.load_default(size_px))
            top += size_px * 2 + 6
    return image


def to_bgr(frame: "Image | np.ndarray") -> np.ndarray:
    """A contiguous HxWx3 BGR uint8 array (what the models read) from a PIL image or such an array."""
    if isinstance(frame, np.ndarray):
        if frame.ndim != 3 or frame.shape[2] != 3 or frame.dtype != np.uint8:
            raise ValueError(f"A frame array must be HxWx3 uint8 (BGR); got shape {frame.shape} {frame.dtype}.")
        return frame.copy(order="C")       # kept as the previous frame: the caller may reuse its buffer
    rgb = np.asarray(frame.convert("RGB"))
    return np.ascontiguousarray(rgb[:, :, ::-1])


def reading_order(lines: list[OcrLine]) -> list[OcrLine]:
    """Top to bottom; lines whose vertical centres are within half a line height form a row, read left to right."""
    rows: list[list[OcrLine]] = []
    for line in sorted(lines, key=lambda ln: (ln.center[1], ln.box[0])):
        row = rows[-1] if rows else None
        if row and abs(line.center[1] - row[0].center[1]) < max(4.0, row[0].height / 2):
            row.append(line)
        else:
            rows.append([line])
    return [line for row in rows for line in sorted(row, key=lambda ln: ln.box[0])]


def _text_key(bgr: np.ndarray, rect: Rect) -> bytes:
    """A digest of the text's own pixels: the line's box in the frame, trimmed to its ink (what differs from
    the box's border colour), so the same text drawn elsewhere, or boxed a pixel wider, has the same key."""
    import hashlib

    patch = bgr[max(0, rect[1]):rect[3], max(0, rect[0]):rect[2]]
    if patch.size:
        border = np.concatenate([patch[0], patch[-1], patch[:, 0], patch[:, -1]])
        ink = (np.abs(patch.astype(np.int16) - np.median(border, axis=0)).max(axis=2) > 40)
        rows, cols = np.flatnonzero(ink.any(axis=1)), np.flatnonzero(ink.any(axis=0))
        if rows.size:
            patch = patch[rows[0]:rows[-1] + 1, cols[0]:cols[-1] + 1]
    return hashlib.blake2b(np.ascontiguousarray(patch).data, digest_size=16,
                           person=f"{patch.shape[0]}x{patch.shape[1]}".encode()[:16]).digest()


def _fit(image: np.ndarray, max_side_px: int) -> tuple[np.ndarray, float]:
    """`image` scaled down so that its longer side is at most `max_side_px`, and the scale used."""
    import cv2

    scale = min(1.0, max_side_px / max(image.shape[:2]))
    if scale == 1.0:
        return image, 1.0
    size = (max(1, round(image.shape[1] * scale)), max(1, round(image.shape[0] * scale)))
    return cv2.resize(image, size, interpolation=cv2.INTER_AREA), scale
