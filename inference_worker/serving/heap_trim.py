"""Hand decoded images' memory back to the OS: after a batch that followed enough decoded pixels, the C heap's
free pages are released (images.release_freed_memory). A settled request lets go of its images at once, but glibc
keeps their pages in the worker's RSS until told; counting pixels keeps the trim off the hot path."""

from __future__ import annotations

import threading
from typing import Iterable

from PIL.Image import Image

from inference_worker.images import TRIM_AFTER_PIXELS, release_freed_memory


class HeapTrim:
    """Pixels decoded since the last trim (preprocessing threads count, the model thread trims)."""

    def __init__(self, after_pixels: int = TRIM_AFTER_PIXELS):
        self.after_pixels = after_pixels
        self._lock = threading.Lock()
        self._num_pixels = 0

    def count(self, images: Iterable[Image]) -> None:
        """Images decoded in this process (none where an engine's own processes decoded them)."""
        with self._lock:
            self._num_pixels += sum(image.width * image.height for image in images)

    def after_batch(self) -> bool:
        """Release the heap's free pages once enough pixels went through; whether it did."""
        with self._lock:
            if self._num_pixels < self.after_pixels:
                return False
            self._num_pixels = 0
        return release_freed_memory()
