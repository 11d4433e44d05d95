"""A read line and its rectangle (`OcrLine`, `Rect`), and where a frame changed since the previous one: the
rectangles the reader reads again (changed rows and columns, grown to cover every old line they touch), with the
rectangle arithmetic it uses. Pure functions on numpy arrays."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

Rect = tuple[int, int, int, int]   # left, top, right, bottom in frame pixels (right/bottom exclusive)


@dataclass(frozen=True)
class OcrLine:
    text: str
    box: Rect
    score: float

    @property
    def height(self) -> int:
        return self.box[3] - self.box[1]

    @property
    def center(self) -> tuple[float, float]:
        return (self.box[0] + self.box[2]) / 2, (self.box[1] + self.box[3]) / 2


def frame_diff(prev: np.ndarray, frame: np.ndarray) -> np.ndarray:
    """|prev - frame| per channel, as an H x (W*3) uint8 array (rows stay contiguous: reductions are fast)."""
    import cv2  # ships with rapidocr-onnxruntime (opencv-python); imported lazily like the models

    return cv2.absdiff(prev, frame).reshape(frame.shape[0], -1)


def changed_regions(diff: np.ndarray, threshold: int, old_lines: Sequence[OcrLine],
                    margin_px: int) -> list[Rect]:
    """Rectangles to re-read: each run of changed rows, spanning its changed columns, grown to cover
    the old lines it touches (a partly changed line is re-read whole); overlapping ones merged.
    A pixel changed when some channel moved by more than `threshold`."""
    rows = np.flatnonzero(diff.max(axis=1) > threshold)
    if rows.size == 0:
        return []
    regions = []
    for top, bottom in _runs(rows, gap=margin_px):
        band = diff[top:bottom].max(axis=0).reshape(-1, 3).max(axis=1)
        cols = np.flatnonzero(band > threshold)
        regions.append((int(cols[0]), int(top), int(cols[-1]) + 1, int(bottom)))
    return _cover_lines(regions, old_lines, margin_px)


def _runs(indices: np.ndarray, gap: int) -> list[tuple[int, int]]:
    """[start, stop) runs of sorted indices, joining runs separated by at most `gap`."""
    breaks = np.flatnonzero(np.diff(indices) > gap + 1)
    starts = np.concatenate(([indices[0]], indices[breaks + 1]))
    stops = np.concatenate((indices[breaks], [indices[-1]])) + 1
    return list(zip(starts.tolist(), stops.tolist()))


def _cover_lines(regions: list[Rect], lines, margin_px: int) -> list[Rect]:
    """Grow regions until no old line straddles a region's edge, merging regions that come to touch."""
    while True:
        grown = [union([r] + [ln.box for ln in lines if overlaps(r, ln.box)]) for r in regions]
        merged = _merge_overlapping(grown, margin_px)
        if merged == regions:
            return regions
        regions = merged


def _merge_overlapping(regions: list[Rect], margin_px: int) -> list[Rect]:
    merged: list[Rect] = []
    for region in sorted(regions, key=lambda r: (r[1], r[0])):
        for i, other in enumerate(merged):
            if overlaps(grow(region, margin_px), other):
                merged[i] = union([region, other])
                break
        else:
            merged.append(region)
    return merged if len(merged) == len(regions) else _merge_overlapping(merged, margin_px)


def whole(bgr: np.ndarray) -> Rect:
    return 0, 0, bgr.shape[1], bgr.shape[0]


def grow(rect: Rect, by_px: int, shape: tuple[int, ...] | None = None) -> Rect:
    left, top, right, bottom = rect[0] - by_px, rect[1] - by_px, rect[2] + by_px, rect[3] + by_px
    if shape is None:
        return left, top, right, bottom
    return max(0, left), max(0, top), min(shape[1], right), min(shape[0], bottom)


def union(rects: list[Rect]) -> Rect:
    return (min(r[0] for r in rects), min(r[1] for r in rects), max(r[2] for r in rects), max(r[3] for r in rects))


def overlaps(a: Rect, b: Rect) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def contains(rect: Rect, point: tuple[float, float]) -> bool:
    return rect[0] <= point[0] < rect[2] and rect[1] <= point[1] < rect[3]


def quad_center(quad: np.ndarray) -> tuple[float, float]:
    return float(quad[:, 0].mean()), float(quad[:, 1].mean())


def quad_rect(quad: np.ndarray) -> Rect:
    return (int(math.floor(quad[:, 0].min())), int(math.floor(quad[:, 1].min())),
            int(math.ceil(quad[:, 0].max())) + 1, int(math.ceil(quad[:, 1].max())) + 1)
