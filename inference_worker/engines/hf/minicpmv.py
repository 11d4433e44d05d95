"""MiniCPM-V 4.6 / 4.7 (native in transformers >= 5.7, model_type `minicpmv4_6`): the image-only processor.

transformers' `MiniCPMV4_6Processor` also builds a video processor, which needs torchvision; without it
`AutoProcessor` quietly returns the bare tokenizer. The worker never sends video, so it loads the processor as
an image processor (the PIL one works without torchvision) plus the tokenizer: same prompt expansion
(`<image_id>N</image_id><image>…</image>` and `<slice>` blocks), same tensors. The model itself is the native
`AutoModelForImageTextToText`; its Qwen3.5 text model mixes linear-attention and full-attention layers, which
the batch decoder merges along the batch (cache_ops.py).

On a CPU the processor cuts a frame into at most as many slices as its pixels fill (`upscale_slices` False:
pixels / 448², rounded up): its own grid search also tries one slice more, to match the frame's aspect, and then
upscales every slice (an 800x600 frame: 4 slices of 400x300, each upscaled to ~518x388, where 2 slices of 400x600
keep ~0.9 of its pixels). On a CPU each slice costs its run of the vision tower and its tokens of prefill, for no
pixel the model would not see otherwise; a GPU keeps the model's own slicing.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

from transformers.image_utils import make_flat_list_of_images
from transformers.models.minicpmv4_6.processing_minicpmv4_6 import MiniCPMV4_6Processor
from transformers.processing_utils import ProcessorMixin

#: the tokenizer's named special tokens the processor reads (real checkpoints name them in tokenizer_config.json)
NAMED_TOKENS = ("image_token", "video_token", "image_start_token", "image_end_token", "slice_start_token",
                "slice_end_token", "image_id_start_token", "image_id_end_token")


class MiniCPMVImageProcessor(MiniCPMV4_6Processor):
    """`MiniCPMV4_6Processor` without its video half: images and text only."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)
        missing = [name for name in NAMED_TOKENS if not getattr(tokenizer, name, None)]
        if missing:
            raise ValueError(f"the MiniCPM-V tokenizer lacks its named special tokens {', '.join(missing)} "
                             "(tokenizer_config.json extra_special_tokens); download the checkpoint again.")
        self.slice_mode = self.image_processor.slice_mode
        self.video_slice_mode = False
        self.default_use_image_id = self.image_processor.use_image_id
        self.image_token_divisor = 4 if self.image_processor.downsample_mode == "4x" else 16
        for name in NAMED_TOKENS:
            setattr(self, name, getattr(tokenizer, name))
        self.image_token_id = tokenizer.image_token_id
        self.video_token_id = tokenizer.video_token_id
        #: False (the worker on a CPU): at most as many slices as the frame's pixels fill (max_slices_for)
        self.upscale_slices = True

    def __call__(self, images=None, text=None, videos=None, **kwargs):
        if videos is not None:
            raise ValueError("DeskEye's MiniCPM-V processor takes images only, not video.")
        if images and not self.upscale_slices and "max_slice_nums" not in kwargs:
            kwargs["max_slice_nums"] = max(self.max_slices_for(image) for image in make_flat_list_of_images(images))
        return super().__call__(images=images, text=text, **kwargs)

    def max_slices_for(self, image) -> int:
        """The most slices `image` (a PIL image) fills: its pixels over one slice's (scale_resolution²), rounded
        up, within the processor's own max_slice_nums. (A request's images share one cap: the largest's.)"""
        processor = self.image_processor
        ratio = image.width * image.height / processor.scale_resolution ** 2
        return max(1, min(processor.max_slice_nums, math.ceil(ratio)))


def load_minicpmv_parts(path: Path, *, dtype, attn_implementation: str, device, step: Callable[[], None]):
    """FAMILIES' parts loader for MiniCPM-V 4.6/4.7: the image-only processor, then the native model."""
    from inference_worker.engines.hf.loading import load_model_weights

    processor = MiniCPMVImageProcessor.from_pretrained(path)
    processor.upscale_slices = device.type == "cuda"      # a CPU: no upscaled slices (module docstring)
    step()
    return load_model_weights(path, processor, dtype=dtype, attn_implementation=attn_implementation, device=device,
                              step=step)
