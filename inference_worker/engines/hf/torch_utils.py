"""Small torch helpers the Hugging Face engines share (each runs on the model thread)."""

from __future__ import annotations

import torch


def apply_num_threads(num_threads: int | None) -> None:
    """torch.set_num_threads on the calling (model) thread; a no-op when unset or already so."""
    if num_threads is not None and torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)


def release_cuda_cache() -> int:
    """Return cached CUDA blocks to the driver; must run on the thread that owns the model's CUDA work.

    Returns the number of torch.cuda.empty_cache() calls made (1, or 0 without CUDA), for the engines' count.
    """
    if not torch.cuda.is_available():
        return 0
    torch.cuda.empty_cache()
    return 1
