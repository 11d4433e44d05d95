"""The vision-language model engine for families transformers supports natively (Idefics3, LLaVA,
MiniCPM-V 4.6, …): images, chat template, processor (its image outputs kept for frames seen again:
image_features.py) and frame keys (`prepare`, on a preprocessing thread, or in child processes: preprocess.py),
then continuous batched decoding with frame KV reuse and JSON-schema-constrained output (`run_batch`, on the model
thread: decoding_engine.py, batch_decode.py), into which requests that arrive meanwhile join through `take_more`.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

import torch

from inference_worker.engines.base import Prepared
from inference_worker.engines.hf.model_forward import has_plain_positions
from inference_worker.engines.hf.decoding_engine import DecodingEngine, FailRow
from inference_worker.engines.hf.image_features import cache_image_features
from inference_worker.engines.hf.loading import LoadedModel
from inference_worker.engines.hf.preprocess import PrepareProcessDied, Preprocessor, image_token_id
from inference_worker.engines.hf.rows import PromptInputs, Row
from inference_worker.engines.hf.sampling import eos_token_ids
from inference_worker.engines.options import EngineOptions
from inference_worker.errors import one_line
from inference_worker.protocol import ChatRequest

if TYPE_CHECKING:
    from PIL.Image import Image

    from inference_worker.engines.hf.preprocess import PrepareProcesses


log = logging.getLogger("inference_worker")

#: model_types whose processor outputs one batch row per prompt (pixel_values (1, ...)) that stack along the batch;
#: MiniCPM-V packs every image's patches into one row (NaViT): packed_images.PACKED_IMAGE_FAMILIES
STACKABLE_IMAGE_FAMILIES = ("idefics3", "smolvlm", "llava")


class TransformersEngine(DecodingEngine):
    kind = "transformers"

    def __init__(self, model: Any, processor: Any, *, model_name: str, options: EngineOptions = EngineOptions()):
        tokenizer = processor.tokenizer
        frame_cache = _frame_cache(options.kv_cache_bytes if has_plain_positions(model) else 0,
                                   options.kv_similar_threshold)
        super().__init__(model, processor, model_name=model_name, options=options, language_model=model,
                         eos_token_ids=eos_token_ids(model.generation_config, tokenizer), frame_cache=frame_cache,
                         holds_prefix_kv=True, can_prefill_together=can_prefill_together(model))
        self.image_token_id = image_token_id(model.config, tokenizer, processor)
        #: the processor's output for a frame seen lately, served again (image_features.py); None: no image processor
        self.image_features = cache_image_features(processor)
        self.preprocessor = Preprocessor(processor, self.image_token_id, model_name,
                                         with_frame_keys=self.frame_cache is not None, escape_text=self.escape_text)
        self._processes: PrepareProcesses | None = None

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, options: EngineOptions = EngineOptions()) -> "TransformersEngine":
        return cls(loaded.model, loaded.processor, model_name=loaded.name, options=options)

    @property
    def prepares_in_processes(self) -> bool:
        """True while preprocessing processes run (they decode the request's images themselves)."""
        return self._processes is not None

    def prepare(self, request: ChatRequest, cancelled: threading.Event | None = None) -> Prepared:
        """As every decoding engine prepares, then the similar-frame search (off the model thread)."""
        item = super().prepare(request, cancelled)
        frame = item.inputs.frame
        if frame is not None:
            frame.nearest = self.frame_cache.nearest(frame.group_key, frame.signature)
        return item

    def start_prepare_processes(self, num_processes: int) -> None:
        """Decode images and run the processor in `num_processes` child processes from now on (preprocess.py
        says why), within this engine's image limits; returns once each has encoded a warm-up request."""
        from inference_worker.engines.hf.preprocess import PrepareProcesses, warm_up_request
        try:
            self._processes = PrepareProcesses(self.preprocessor, num_processes, image_limits=self.image_limits,
                                               warm_up=warm_up_request())
        except Exception as exc:  # noqa: BLE001 - e.g. a processor that cannot be pickled: threads still serve
            log.warning("--prepare-processes %d: cannot prepare in child processes (%s); preprocessing stays on "
                        "the worker's threads", num_processes, one_line(exc))
            return
        log.info("preprocessing in %d process(es): pid %s", num_processes, ", ".join(map(str, self._processes.pids)))

    def close(self) -> None:
        if self._processes is not None:
            self._processes.close()
            self._processes = None
        if self.image_features is not None:
            self.image_features.clear()
        super().close()

    def decoder_row(self, item: Prepared) -> Row:
        """The decoder's row for one attempt: inputs on the device and a fresh copy of the compiled grammar."""
        return self._row(item, self._on_device(item.inputs))

    # ------------------------------------------------------------ DecodingEngine

    def _encode(self, request: ChatRequest, cancelled: threading.Event) -> tuple[list["Image"], PromptInputs]:
        """In an idle preprocessing process when there is one (it decodes the images: none come back), else here."""
        processes = self._processes
        if processes is not None:
            try:
                inputs = processes.try_encode(request)
                if inputs is not None:
                    return [], inputs
            except PrepareProcessDied as exc:
                log.warning("a preprocessing process died (%s); preprocessing goes on in the worker's threads", exc)
                self._processes = None
                processes.close()
        images = self.decode_images(request, cancelled)
        return images, self.preprocessor.encode(request.messages, images)

    def _decoder_rows(self, items: list[tuple[int, Prepared]], fail: FailRow) -> list[tuple[int, Row]]:
        """Each item's row; one whose inputs cannot move to the device fails alone."""
        rows = []
        for index, item in items:
            try:
                rows.append((index, self.decoder_row(item)))
            except Exception as exc:  # noqa: BLE001 - that request's answer
                fail(index, exc)
        return rows

    def _on_device(self, inputs: PromptInputs) -> PromptInputs:
        vision = {}
        for key, value in inputs.vision.items():
            if torch.is_tensor(value):
                if torch.is_floating_point(value):
                    value = value.to(self.model.dtype)
                value = value.to(self.device)
            vision[key] = value
        embeds = None if inputs.prefix_embeds is None else inputs.prefix_embeds.to(self.device, self.model.dtype)
        return PromptInputs(inputs.prefix_ids.to(self.device), inputs.suffix_ids.to(self.device), vision,
                            inputs.num_images, inputs.frame, embeds, inputs.grammar)


def can_prefill_together(model: Any) -> bool:
    """Whether cold rows of this model may be prefilled in one left-padded forward: a family whose image tensors
    stack along the batch (pixel_values, pixel_attention_mask) with plain attention layers, or MiniCPM-V 4.6, whose
    images pack NaViT-style (packed_images.py) and whose hybrid cache (linear + full attention) cache_ops merges
    and splits: its linear layers zero padded inputs, so left padding leaves their conv and recurrent states as a
    solo prefill does (tests/test_batched_prefill.py)."""
    from transformers import DynamicCache

    from inference_worker.engines.hf.cache_ops import can_merge_layers, is_plain_attention
    from inference_worker.engines.hf.packed_images import PACKED_IMAGE_FAMILIES

    cache = DynamicCache(config=model.config)
    if model.config.model_type in PACKED_IMAGE_FAMILIES:
        return can_merge_layers(cache)
    return model.config.model_type in STACKABLE_IMAGE_FAMILIES and is_plain_attention(cache)


def _frame_cache(max_bytes: int, similar_threshold: float | None):
    if max_bytes <= 0:
        return None
    from inference_worker.engines.hf.frame_cache import FrameCache
    return FrameCache(max_bytes, similar_threshold)


def make_engine(loaded: LoadedModel, options: EngineOptions) -> TransformersEngine:
    """FAMILIES' engine factory for the families transformers supports natively."""
    engine = TransformersEngine.from_loaded(loaded, options)
    if options.prepare_processes:
        engine.start_prepare_processes(options.prepare_processes)
    return engine
