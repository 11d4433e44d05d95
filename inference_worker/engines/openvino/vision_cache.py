"""Vision features kept per frame: a frame seen before (same preprocessed pixels) skips the vision encoder.

Keyed by a hash of the preprocessed pixel values; least recently used dropped first once `max_bytes` is passed.
Only the model thread touches it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np


def frame_hash(pixel_values: np.ndarray) -> str:
    """The cache key of one request's preprocessed images (shape and dtype included)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{pixel_values.shape}{pixel_values.dtype}".encode())
    digest.update(np.ascontiguousarray(pixel_values).tobytes())
    return digest.hexdigest()


class VisionCache:
    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 (0 = no cache); got {max_bytes}.")
        self.max_bytes = max_bytes
        self._features: OrderedDict[str, np.ndarray] = OrderedDict()
        self.num_bytes = 0
        self.num_hits = 0
        self.num_evictions = 0

    @property
    def num_entries(self) -> int:
        return len(self._features)

    def get(self, key: str) -> np.ndarray | None:
        features = self._features.get(key)
        if features is not None:
            self._features.move_to_end(key)
            self.num_hits += 1
        return features

    def put(self, key: str, features: np.ndarray) -> None:
        if features.nbytes > self.max_bytes or key in self._features:
            return
        self._features[key] = features
        self.num_bytes += features.nbytes
        while self.num_bytes > self.max_bytes:
            _, dropped = self._features.popitem(last=False)
            self.num_bytes -= dropped.nbytes
            self.num_evictions += 1

    def clear(self) -> None:
        self._features.clear()
        self.num_bytes = 0
