"""The frame cache: a byte-bounded LRU of per-frame model state (prefix KV, vision features), with two levels.

- *exact*: an entry stored under the same `exact_key` (the caller hashes preprocessed pixels, prompt-prefix
  token ids and the model name, e.g. with content_key.py).
- *similar*: an entry of the same `group_key` (same model, same prompt-prefix ids, same image layout) whose
  frame is perceptually close: `frame_distance` of the two `FrameSignature`s at most `similar_threshold`.
  This is an approximation — the model then sees the older frame — so it is off when the threshold is None.

Values are opaque here except for their size (`tensor_nbytes`); torch is imported only when a size or key is
computed. An evicted value is dropped, so nothing here keeps its tensors alive.

What an entry costs is counted as what it really holds: the value's tensor storage (given by the caller), its frame
signature's thumbnails and cell sums (~166 KB per image: more than a tiny model's whole KV) and the per-entry Python
objects and allocator rounding (`ENTRY_OVERHEAD_BYTES`, measured). Freed KV leaves holes in the C heap that RSS
keeps; after evicting a share of the budget the cache hands them back to the OS (glibc `malloc_trim`), so the
process's RSS stays within the budget rather than within the budget plus fragmentation.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable

import numpy as np

from inference_worker.images import release_freed_memory
from inference_worker.protocol import CacheLevel

if TYPE_CHECKING:
    from PIL.Image import Image

GRID = (64, 48)                    # (columns, rows) of cells the similar threshold counts: 3072 cells
SUBCELLS = 4                       # each cell is compared as 4x4 sub-cells of an RGB thumbnail (256x192)
#: levels (0..255, any channel) a sub-cell mean may move before its cell counts as changed. A sub-cell averages
#: ~10 pixels of an 800x600 frame (one fully changed pixel moves it ~23 levels) or ~42 of a full-HD one (~5 per
#: pixel): JPEG (quality >= 80) ringing stays under 16, a cursor or a changed glyph goes over. Measured on
#: 800x600, 1280x800 and 1920x1080 screens: plain 64x48 grey means (tolerance 8) saw a changed text line at full
#: HD as 2 cells (under the default threshold's 6) and a same-brightness colour change as 0 cells; 4x4 RGB
#: sub-cells see 15 and 120.
CELL_TOLERANCE = 16
#: the similar level compares a frame with this many most recently stored frames of its group (their cell sums
#: in one vectorised pass, ~0.25 ms for 32; then in full, ~0.3 ms each, only those the sums cannot rule out): the
#: frame it resembles is the screen of moments ago, and a full cache holds thousands
MAX_SIMILAR_CANDIDATES = 32
#: what an entry holds beyond its tensors and thumbnails: the cache object and its layers, tensor and storage
#: headers, the keys, the LRU and group slots, malloc rounding. Measured on CPU (RSS after malloc_trim, 400
#: entries in a fresh process): 19-23 KB per entry for 2-16 layer DynamicCaches.
ENTRY_OVERHEAD_BYTES = 24 * 1024
#: evicting this share of the budget (at least MIN_RELEASE_BYTES) since the last release hands freed heap
#: pages back to the OS
RELEASE_SHARE = 1 / 16
MIN_RELEASE_BYTES = 4 * 1024 * 1024
#: `lookup`'s default `nearest`: no search was done while preparing, so the lookup searches itself
NOT_SEARCHED = "not searched"


@dataclass(frozen=True, eq=False)
class FrameSignature:
    """Per image: its RGB thumbnail (GRID x SUBCELLS, uint8, rows x columns x 3), the per-cell sums of that
    thumbnail (GRID, int16, rows x columns x 3: what the search compares first) and its original (width, height)."""
    thumbnails: tuple[np.ndarray, ...]
    sizes: tuple[tuple[int, int], ...]
    cell_sums: tuple[np.ndarray, ...] = field(init=False)          # derived from the thumbnails, once

    def __post_init__(self):
        object.__setattr__(self, "cell_sums", tuple(_cell_sums(t) for t in self.thumbnails))

    @property
    def nbytes(self) -> int:
        return sum(array.nbytes for array in (*self.thumbnails, *self.cell_sums))


def frame_signature(images: Iterable["Image"]) -> FrameSignature:
    """A cheap perceptual fingerprint of a request's images (~2 ms per 800x600 frame, 5-7 ms full HD, measured
    on 2 shared cores): compute it off the model thread."""
    from PIL import Image

    images = list(images)
    size = (GRID[0] * SUBCELLS, GRID[1] * SUBCELLS)
    rgb = [img if img.mode == "RGB" else img.convert("RGB") for img in images]
    thumbnails = tuple(np.asarray(img.resize(size, Image.BOX), dtype=np.uint8) for img in rgb)
    return FrameSignature(thumbnails, tuple(img.size for img in images))


def frame_distance(a: FrameSignature, b: FrameSignature) -> float:
    """Share (0..1) of the 64x48 cells in which some sub-cell moved more than CELL_TOLERANCE, the worst over the
    images; math.inf when the image counts or sizes differ (such frames never stand in for each other)."""
    if a.sizes != b.sizes:
        return math.inf
    return max((_changed_share(x, y) for x, y in zip(a.thumbnails, b.thumbnails)), default=0.0)


def lower_bounds(signature: FrameSignature, others: list[FrameSignature]) -> np.ndarray:
    """For each of `others`, a share that `frame_distance(signature, other)` is at least (inf where the sizes
    differ), from the cell sums in one vectorised pass: a cell whose 16 sub-cell values (per channel) sum to more
    than 16 x CELL_TOLERANCE apart has a sub-cell that moved more than CELL_TOLERANCE, so it is a changed cell."""
    bounds = np.full(len(others), math.inf)
    same = [i for i, other in enumerate(others) if other.sizes == signature.sizes]
    if not same:
        return bounds
    shares = np.zeros(len(same))
    for image, sums in enumerate(signature.cell_sums):
        difference = np.stack([others[i].cell_sums[image] for i in same])                # (n, rows, columns, 3)
        difference -= sums
        np.abs(difference, out=difference)                 # in int16: sums are at most 16 x 255 apart
        moved = difference > CELL_TOLERANCE * SUBCELLS * SUBCELLS
        cells = moved[..., 0] | moved[..., 1] | moved[..., 2]          # any channel (a reduction over 3 is slow)
        shares = np.maximum(shares, np.count_nonzero(cells.reshape(len(same), -1), axis=1) / (GRID[0] * GRID[1]))
    bounds[same] = shares
    return bounds


def _changed_share(a: np.ndarray, b: np.ndarray) -> float:
    difference = np.maximum(a, b)
    difference -= np.minimum(a, b)                               # |a - b| in uint8, without a wider copy
    moved = (difference > CELL_TOLERANCE).reshape(GRID[1], SUBCELLS, GRID[0], SUBCELLS * 3)   # rows of RGB values
    return float(np.count_nonzero(moved.any(axis=(1, 3)))) / (GRID[0] * GRID[1])


def _cell_sums(thumbnail: np.ndarray) -> np.ndarray:
    """(rows, columns, 3) int16: each cell's 4x4 sub-cell values summed per channel (at most 16 x 255). The sub-cell
    columns are added as whole int16 slices, then the rows: 4x faster than numpy's sum over a strided axis."""
    wide = thumbnail.astype(np.int16).reshape(GRID[1] * SUBCELLS, GRID[0], SUBCELLS, 3)
    columns = wide[:, :, 0].copy()
    for i in range(1, SUBCELLS):
        columns += wide[:, :, i]
    rows = columns.reshape(GRID[1], SUBCELLS, GRID[0], 3)
    sums = rows[:, 0].copy()
    for i in range(1, SUBCELLS):
        sums += rows[:, i]
    return sums


def tensor_nbytes(obj: Any) -> int:
    """Bytes of torch storage held by `obj`: tensors inside lists, tuples, dicts and transformers caches (every
    tensor of every cache layer: keys/values, conv/recurrent states). Each storage counts once, in full — a view
    keeps its whole base alive."""
    storages: dict[tuple[str, int], int] = {}
    for tensor in _tensors(obj):
        storage = tensor.untyped_storage()
        storages[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def _tensors(obj: Any):
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(getattr(obj, "layers", None), list):           # a transformers Cache
        for layer in obj.layers:
            yield from _tensors(vars(layer))


@dataclass(frozen=True)
class Lookup:
    value: Any | None
    level: CacheLevel              # EXACT | SIMILAR | MISS
    distance: float = math.inf     # frame_distance to the entry used: 0.0 for exact, inf for a miss


@dataclass
class _Entry:
    group_key: bytes
    signature: FrameSignature | None
    value: Any
    num_bytes: int


class FrameCache:
    """Byte-bounded LRU of per-frame values with an exact and a similar level; safe to share between threads.

    `max_bytes` 0 turns it off (nothing is stored, every lookup misses); `similar_threshold` None turns the
    similar level off. `on_evict(value)` is called (outside the lock) for each value evicted to make room.
    `entry_overhead_bytes` is added to each entry's count (see ENTRY_OVERHEAD_BYTES); `release_memory` runs
    (outside the lock) after evictions add up to RELEASE_SHARE of the budget.
    """

    def __init__(self, max_bytes: int, similar_threshold: float | None = None,
                 on_evict: Callable[[Any], None] | None = None, *,
                 entry_overhead_bytes: int = ENTRY_OVERHEAD_BYTES,
                 release_memory: Callable[[], Any] = release_freed_memory):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 (0 = cache off); got {max_bytes}")
        if entry_overhead_bytes < 0:
            raise ValueError(f"entry_overhead_bytes must be >= 0; got {entry_overhead_bytes}")
        if similar_threshold is not None and not 0 <= similar_threshold <= 1:
            raise ValueError(f"similar_threshold must be None (off) or a share from 0 to 1; got {similar_threshold}")
        self.max_bytes = max_bytes
        self.similar_threshold = similar_threshold
        self.on_evict = on_evict
        self.entry_overhead_bytes = entry_overhead_bytes
        self._release_memory = release_memory
        self._release_after_bytes = max(MIN_RELEASE_BYTES, int(max_bytes * RELEASE_SHARE))
        self._evicted_since_release = 0
        self.num_memory_releases = 0
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()      # least recently used first
        self._groups: dict[bytes, dict[bytes, None]] = {}               # group_key -> its exact keys
        self._lock = threading.Lock()
        self.num_bytes = 0
        self.num_exact_hits = 0
        self.num_similar_hits = 0
        self.num_misses = 0
        self.num_evictions = 0

    @property
    def is_enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    def lookup(self, exact_key: bytes, group_key: bytes, signature: FrameSignature | None,
               nearest: Any = NOT_SEARCHED) -> Lookup:
        """The entry for `exact_key`, else (similar level on) the closest frame of `group_key` within the
        threshold, else a miss. A hit becomes the most recently used entry. `nearest` is `self.nearest(...)`
        computed earlier off the model thread — a (key, distance) found, or None: searched, nothing close — and is
        then trusted (an entry evicted since is a miss); only NOT_SEARCHED makes the lookup search here."""
        with self._lock:
            if nearest is NOT_SEARCHED:
                nearest = self._closest(self._candidates(group_key, signature), signature)
            elif nearest is not None and nearest[0] not in self._entries:
                nearest = None
            found = (exact_key, 0.0) if exact_key in self._entries else nearest
            if found is None:
                self.num_misses += 1
                return Lookup(None, CacheLevel.MISS)
            key, distance = found
            self._entries.move_to_end(key)
            if key == exact_key:
                self.num_exact_hits += 1
                return Lookup(self._entries[key].value, CacheLevel.EXACT, 0.0)
            self.num_similar_hits += 1
            return Lookup(self._entries[key].value, CacheLevel.SIMILAR, distance)

    def nearest(self, group_key: bytes, signature: FrameSignature | None) -> tuple[bytes, float] | None:
        """(key, distance) of the closest kept frame of `group_key` within the similar threshold, or None. Thread
        safe, and the comparing happens outside the lock: call it while preparing a request, pass it to lookup."""
        with self._lock:
            candidates = self._candidates(group_key, signature)
        return self._closest(candidates, signature)

    def _candidates(self, group_key: bytes, signature: FrameSignature | None) -> list[tuple[bytes, FrameSignature]]:
        """The group's most recently stored frames (caller holds the lock)."""
        if self.similar_threshold is None or signature is None:
            return []
        recent = itertools.islice(reversed(self._groups.get(group_key, {})), MAX_SIMILAR_CANDIDATES)
        return [(key, self._entries[key].signature) for key in recent if self._entries[key].signature is not None]

    def _closest(self, candidates: list[tuple[bytes, FrameSignature]],
                 signature: FrameSignature | None) -> tuple[bytes, float] | None:
        """The closest candidate within the threshold: the cell sums rule most out at once (`lower_bounds`), and
        only frames that may be within it are compared in full, most promising first."""
        if not candidates:
            return None
        bounds = lower_bounds(signature, [other for _, other in candidates])
        best: tuple[float, int] | None = None                 # (distance, index): the most recent of the closest
        for i in map(int, np.argsort(bounds, kind="stable")):
            if bounds[i] > (self.similar_threshold if best is None else best[0]):
                break
            distance = frame_distance(signature, candidates[i][1])
            if distance <= self.similar_threshold and (best is None or (distance, i) < best):
                best = (distance, i)
        return None if best is None else (candidates[best[1]][0], best[0])

    def entry_nbytes(self, signature: FrameSignature | None, value_nbytes: int) -> int:
        """What an entry whose value holds `value_nbytes` of tensors really costs (see the module docstring)."""
        return value_nbytes + (signature.nbytes if signature is not None else 0) + self.entry_overhead_bytes

    def put(self, exact_key: bytes, group_key: bytes, signature: FrameSignature | None, value: Any,
            num_bytes: int) -> bool:
        """Store (or replace) an entry as the most recent, evicting least recently used ones until the cache fits
        `max_bytes`. `num_bytes` is the value's own size (`tensor_nbytes`); the entry counts `entry_nbytes`.
        An entry larger than `max_bytes` is not stored (returns False; the cache is unchanged)."""
        if num_bytes < 0:
            raise ValueError(f"num_bytes must be >= 0; got {num_bytes}")
        total_bytes = self.entry_nbytes(signature, num_bytes)
        if total_bytes > self.max_bytes or not self.is_enabled:
            return False
        with self._lock:
            self._remove(exact_key)
            self._entries[exact_key] = _Entry(group_key, signature, value, total_bytes)
            self._groups.setdefault(group_key, {})[exact_key] = None
            self.num_bytes += total_bytes
            evicted, evicted_bytes = self._evict_to_fit()
            self._evicted_since_release += evicted_bytes
            should_release = self._evicted_since_release >= self._release_after_bytes
            if should_release:
                self._evicted_since_release = 0
        self._notify_evicted(evicted)
        if should_release:
            del evicted
            self._release_memory()
            self.num_memory_releases += 1
        return True

    def clear(self) -> None:
        """Drop every entry (counters stay)."""
        with self._lock:
            self._entries.clear()
            self._groups.clear()
            self.num_bytes = 0

    def _remove(self, exact_key: bytes) -> _Entry | None:
        entry = self._entries.pop(exact_key, None)
        if entry is not None:
            self.num_bytes -= entry.num_bytes
            group = self._groups[entry.group_key]
            del group[exact_key]
            if not group:
                del self._groups[entry.group_key]
        return entry

    def _evict_to_fit(self) -> tuple[list[Any], int]:
        evicted, evicted_bytes = [], 0
        while self.num_bytes > self.max_bytes:
            entry = self._remove(next(iter(self._entries)))
            evicted.append(entry.value)
            evicted_bytes += entry.num_bytes
            self.num_evictions += 1
        return evicted, evicted_bytes

    def _notify_evicted(self, values: list[Any]) -> None:
        if self.on_evict is not None:
            for value in values:
                self.on_evict(value)
