"""NaViT-packed image inputs (MiniCPM-V 4.6): how several prompts' images go into one batched forward.

Such a model's image tensors do not stack along the batch: its processor packs every image's patches into ONE
row, `pixel_values` (1, channels, patch, sum of patches) with `target_sizes` (images, 2) in patches, and the model
reads only `pixel_values[:1]`, splits it by `target_sizes` and scatters the features over the image tokens in
order, row 0's first. Prompts prefilled together therefore pack their images the same way, in row order: what
the processor itself makes for a batch of prompts (tests/test_batched_prefill.py compares the two).

No transformers import here: the batch decoder also runs in MiniCPM-o's pinned environment.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

#: model_types whose image inputs are packed so; MiniCPM-V 4.7 shares the processor but has no fixture here
PACKED_IMAGE_FAMILIES = ("minicpmv4_6",)

PACKED_KEYS = frozenset({"pixel_values", "target_sizes"})


def packs_images(model: Any) -> bool:
    """Whether this model takes its prompts' images NaViT-packed (else stacked along the batch)."""
    return getattr(getattr(model, "config", None), "model_type", None) in PACKED_IMAGE_FAMILIES


def packed_image_layout(vision: dict[str, torch.Tensor]) -> tuple | None:
    """What prompts must share to pack their images together (the shapes but for the packed axis, dtypes): () for
    a prompt without images; None when the tensors are not the processor's (1, C, patch, n) pixel_values and
    (images, 2) target_sizes."""
    if not vision:
        return ()
    if set(vision) != PACKED_KEYS or not all(torch.is_tensor(v) for v in vision.values()):
        return None
    pixels, sizes = vision["pixel_values"], vision["target_sizes"]
    if pixels.ndim != 4 or pixels.shape[0] != 1 or sizes.ndim != 2 or sizes.shape[1] != 2:
        return None
    return (tuple(pixels.shape[:-1]), pixels.dtype, sizes.dtype)


def pack_image_inputs(visions: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Several prompts' image inputs (all of one `packed_image_layout`) as one batch's: patches concatenated along
    the packed axis and sizes along the images, in row order."""
    if not visions[0]:
        return {}
    return {"pixel_values": torch.cat([v["pixel_values"] for v in visions], dim=-1),
            "target_sizes": torch.cat([v["target_sizes"] for v in visions], dim=0)}
