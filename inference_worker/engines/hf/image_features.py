"""The image processor's output for pixels seen lately: kept, not computed again.

A screen asked about twice (the hotkey on an unchanged screen, "what was that?", another question about the same
frame) comes with the same pixels. The frame KV cache (frame_cache.py) then skips the vision tower and the prefix's
prefill, but before it can look the frame up the processor has resized, sliced and normalised the image again: about
50 of the ~190 ms to a first token for a repeated 800x600 frame on the real-size Idefics3 stand-in (2 cores, bf16;
benchmarks/real_size.py), where vLLM answers from its multimodal processor cache.

`CachedImageProcessor` wraps a processor's `image_processor`, which every transformers processor calls from its
`_process_images` (Idefics3, MiniCPM-V 4.6 and the generic ProcessorMixin alike), and answers a call whose images
(mode, size and every pixel, hashed: ~1 ms for 800x600) and arguments it saw lately with the output it gave then.
The processor still builds and tokenizes the prompt's text around it. The output's tensors are shared with the cache,
so a tensor changed in place afterwards (its version counter moved) drops the entry instead of being served. Calls
with anything but PIL images, or arguments that are not plain values, go to the processor as they are.
"""

from __future__ import annotations

import copy
import hashlib
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

#: what the kept outputs may hold in all: two 1920x1080 frames of MiniCPM-V 4.6 (~24 MB of patches each), or four
#: 800x600 frames of the Idefics3 stand-in (~15 MB each). The frames asked about again are the last one or two.
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
#: ... and at most this many, whatever their size: small frames (a small model's processor) must not fill the byte
#: budget with thousands of entries that the frame KV cache's budget does not count (tests/test_kv_soak.py)
DEFAULT_MAX_ENTRIES = 4
_PLAIN = (str, int, float, bool, type(None))
_OWN = frozenset({"inner", "max_bytes", "max_entries", "num_hits", "num_misses", "num_bytes", "_entries", "_lock"})


class CachedImageProcessor:
    """`inner` (an image processor) with its recent outputs kept, LRU, at most `max_entries` of them and `max_bytes`
    of tensors and arrays; thread-safe (the preprocessing threads share it), picklable without its entries
    (preprocessing processes). Every other attribute is `inner`'s."""

    def __init__(self, inner: Any, max_bytes: int = DEFAULT_MAX_BYTES, max_entries: int = DEFAULT_MAX_ENTRIES):
        if max_bytes < 0 or max_entries < 0:
            raise ValueError(f"max_bytes and max_entries must be >= 0; got {max_bytes!r}, {max_entries!r}.")
        for name, value in dict(inner=inner, max_bytes=max_bytes, max_entries=max_entries, num_hits=0, num_misses=0,
                                num_bytes=0, _entries=OrderedDict(), _lock=threading.Lock()).items():
            object.__setattr__(self, name, value)

    def __call__(self, images: Any = None, *args: Any, **kwargs: Any) -> Any:
        key = _key(images, args, kwargs)
        if key is None:
            return self.inner(images, *args, **kwargs)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and _unchanged(entry):
                self._entries.move_to_end(key)
                self.num_hits += 1
                return _copy(entry[0])
            if entry is not None:
                self._drop(key)
            self.num_misses += 1
        output = self.inner(images, *args, **kwargs)
        self._keep(key, output)
        return _copy(output)

    def __getattr__(self, name: str) -> Any:
        """Only for what the wrapper lacks: the image processor's settings and methods."""
        if "inner" not in self.__dict__:            # being unpickled
            raise AttributeError(name)
        return getattr(self.__dict__["inner"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        """The wrapper's own counters stay here; any other attribute is a setting of the image processor, set on it,
        and the kept outputs (made with the old setting) are dropped."""
        if name in _OWN:
            object.__setattr__(self, name, value)
            return
        self.clear()
        setattr(self.inner, name, value)

    def __getstate__(self) -> dict:
        return {"inner": self.inner, "max_bytes": self.max_bytes, "max_entries": self.max_entries}

    def __setstate__(self, state: dict) -> None:
        CachedImageProcessor.__init__(self, state["inner"], state["max_bytes"], state["max_entries"])

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.num_bytes = 0

    def _keep(self, key: bytes, output: Any) -> None:
        size, versions = _num_bytes(output), _versions(output)
        if size > self.max_bytes or self.max_entries == 0 or None in versions:
            return
        with self._lock:
            if key in self._entries:
                self._drop(key)
            while self._entries and (self.num_bytes + size > self.max_bytes or len(self._entries) >= self.max_entries):
                self._drop(next(iter(self._entries)))
            self._entries[key] = (output, size, versions)
            self.num_bytes += size

    def _drop(self, key: bytes) -> None:
        """Under the lock."""
        _output, size, _versions_then = self._entries.pop(key)
        self.num_bytes -= size


def _key(images: Any, args: tuple, kwargs: dict) -> bytes | None:
    """A digest of the images (mode, size, pixels) and the call's arguments; None where either is not plain."""
    flat = _flat_images(images)
    if not flat or not _is_plain((args, kwargs)):
        return None
    digest = hashlib.sha256(repr((args, sorted(kwargs.items()))).encode())
    for image in flat:
        digest.update(f"|{image.mode}{image.size}|".encode())
        digest.update(image.tobytes())
    return digest.digest()


def _flat_images(images: Any) -> list | None:
    """The PIL images of `images` (one, or nested lists of them); None if anything else is in it."""
    from PIL import Image

    if isinstance(images, Image.Image):
        return [images]
    if not isinstance(images, (list, tuple)):
        return None
    flat = []
    for item in images:
        inner = _flat_images(item)
        if inner is None:
            return None
        flat.extend(inner)
    return flat


def _is_plain(value: Any, depth: int = 0) -> bool:
    if depth > 8:
        return False
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_plain(item, depth + 1) for item in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain(v, depth + 1) for k, v in value.items())
    return False


def _values(output: Any) -> list:
    return list(output.values()) if hasattr(output, "values") else []


def _num_bytes(output: Any) -> int:
    size = 0
    for value in _values(output):
        if isinstance(value, torch.Tensor):
            size += value.numel() * value.element_size()
        elif isinstance(value, np.ndarray):
            size += value.nbytes
    return size


def _versions(output: Any) -> tuple:
    """Each tensor's in-place version counter as it was kept (None for an inference-mode tensor, which counts
    none: such an output is not kept)."""
    versions = []
    for value in _values(output):
        if isinstance(value, torch.Tensor):
            try:
                versions.append(value._version)
            except RuntimeError:
                versions.append(None)
    return tuple(versions)


def _unchanged(entry: tuple) -> bool:
    output, _size, versions = entry
    return _versions(output) == versions


def _copy(output: Any) -> Any:
    """A new mapping of the kept output: tensors and arrays shared, everything else (lists of sizes, rows and
    columns a processor may pop or change) copied."""
    fresh = copy.copy(output)
    for name, value in list(fresh.items()):
        if not isinstance(value, (torch.Tensor, np.ndarray)):
            fresh[name] = copy.deepcopy(value)
    return fresh


def cache_image_features(processor: Any, max_bytes: int = DEFAULT_MAX_BYTES,
                         max_entries: int = DEFAULT_MAX_ENTRIES) -> CachedImageProcessor | None:
    """Wrap `processor.image_processor` (once); the wrapper, or None for a processor without one."""
    inner = getattr(processor, "image_processor", None)
    if inner is None:
        return None
    if isinstance(inner, CachedImageProcessor):
        return inner
    cached = CachedImageProcessor(inner, max_bytes, max_entries)
    processor.image_processor = cached
    return cached
