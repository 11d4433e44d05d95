"""The MiniCPM-o 4.5 engine (`openbmb/MiniCPM-o-4_5`, loaded by minicpmo_loading.py): vision only, batched.

**Vision only, never the audio path.** The model is loaded with `init_audio=False, init_tts=False`, so it has no
`apm`; its `generate()` and `chat()` always go through `get_omni_embedding` -> `get_audio_embedding` -> `self.apm`
and fail (AttributeError) on the first request. This engine therefore never calls them: it builds each row's
`inputs_embeds` itself with the model's `get_vllm_embedding` (vision encoder + resampler, features scattered
over the processor's `image_bound`) and decodes the inner Qwen3 LM (`model.llm`) with the shared
`BatchDecoder`, so rows batch, sample, follow a grammar and stop like any other model's. The prompt is built
as `chat()` builds it: `<image>./</image>` per image, the Qwen3 template with `enable_thinking=False` (an empty
think block opens the reply), the model's processor (image ids, 448 px slices).

**Vision reuse** is at the exact level: the vision features (`vision_hidden_states`) of a request's images are
kept in a FrameCache keyed by a hash of the preprocessed pixels and the model; a new question about the same
frame skips the vision encoder (the LM still prefills the whole prompt).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from inference_worker.engines.base import Prepared
from inference_worker.engines.hf.decoding_engine import DecodingEngine, FailRow
from inference_worker.engines.hf.content_key import content_key
from inference_worker.engines.hf.frame_cache import FrameCache, tensor_nbytes
from inference_worker.engines.hf.rows import PromptInputs, Row
from inference_worker.engines.options import EngineOptions
from inference_worker.errors import PromptTooLongError
from inference_worker.protocol import CacheLevel, ChatRequest, ImagePart, Message

if TYPE_CHECKING:
    from PIL.Image import Image

    from inference_worker.engines.hf.loading import LoadedModel

log = logging.getLogger("inference_worker")

IMAGE_PLACEHOLDER = "<image>./</image>"   # what chat() puts where an image was
MAX_INPUT_TOKENS = 8192                   # chat()'s default max_inp_length (it truncates; this engine refuses)
DEFAULT_VISION_CACHE_BYTES = 256 * 1024 * 1024   # ~50 frames of MiniCPM-o 4.5 features (10 slices x 64 x 4096, bf16)


@dataclass
class MiniCPMOInputs:
    """A request as the processor made it (on a preprocessing thread)."""
    input_ids: torch.Tensor          # (1, n) int64
    pixel_values: list               # the row's slices: (3, patch, n * patch) strips
    tgt_sizes: Any                   # (num_slices, 2) int tensor, or [] without images
    image_bound: torch.Tensor        # (num_slices, 2): [start, end) of each slice's <unk> run
    num_images: int
    vision_key: bytes | None         # FrameCache key of the preprocessed pixels; None without images or cache
    grammar: Any = None              # the request's compiled grammar (made while preparing); each attempt copies it

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])


class MiniCPMOEngine(DecodingEngine):
    """The decoder runs the inner LM (`model.llm`) on embeddings this engine builds; the frame cache holds vision
    features (`vision_cache_bytes`; 0 = off), at the exact level only. Prompts are bounded by the LM's context
    (or --max-prompt-tokens) and by chat()'s MAX_INPUT_TOKENS."""

    kind = "minicpmo"

    def __init__(self, model: Any, processor: Any, *, model_name: str, options: EngineOptions = EngineOptions(),
                 vision_cache_bytes: int = DEFAULT_VISION_CACHE_BYTES):
        super().__init__(model, processor, model_name=model_name, options=options, language_model=model.llm,
                         eos_token_ids=terminator_ids(model, processor.tokenizer),
                         frame_cache=FrameCache(vision_cache_bytes, similar_threshold=None), holds_prefix_kv=False)

    @classmethod
    def from_loaded(cls, loaded: "LoadedModel", options: EngineOptions = EngineOptions(),
                    **kwargs: Any) -> "MiniCPMOEngine":
        return cls(loaded.model, loaded.processor, model_name=loaded.name, options=options, **kwargs)

    # ------------------------------------------------------------ DecodingEngine

    def _encode(self, request: ChatRequest, cancelled: threading.Event) -> tuple[list["Image"], MiniCPMOInputs]:
        """Images, template, processor and the frame's vision key (as chat() prepares). A prompt over
        MAX_INPUT_TOKENS is refused (PromptTooLongError)."""
        images = self.decode_images(request, cancelled)
        msgs = chat_messages(request.messages, self.escape_text)
        prompt = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                                    enable_thinking=False)
        batch = self.processor([prompt], [images], None, None, max_slice_nums=None, use_image_id=None,
                               return_tensors="pt", max_length=None)
        input_ids = batch["input_ids"].long()
        num_tokens = int(input_ids.shape[1])
        if num_tokens > MAX_INPUT_TOKENS:
            raise PromptTooLongError(f"The prompt is {num_tokens} tokens long, {num_tokens - MAX_INPUT_TOKENS} more "
                                     f"than MiniCPM-o's {MAX_INPUT_TOKENS}: send fewer or smaller images, a shorter "
                                     "question or fewer earlier turns.", num_tokens=num_tokens,
                                     max_tokens=MAX_INPUT_TOKENS)
        inputs = MiniCPMOInputs(input_ids, batch["pixel_values"][0], batch["tgt_sizes"][0], batch["image_bound"][0],
                                num_images=len(images), vision_key=None)
        if images and self.frame_cache.is_enabled:
            inputs.vision_key = content_key(self.model_name, inputs.pixel_values, inputs.tgt_sizes)
        return images, inputs

    def _decoder_rows(self, items: list[tuple[int, Prepared]], fail: FailRow) -> list[tuple[int, Row]]:
        """Embed every row (one vision-encoder call for the frames not cached); a row the model cannot embed fails
        alone."""
        cached = [self._cached_features(item.inputs) for _, item in items]
        encoded = self._encode_together([item.inputs for _, item in items], cached)
        rows = []
        for position, (index, item) in enumerate(items):
            try:
                embeds, level = self._embed(item.inputs, cached[position], encoded.get(position))
            except Exception as exc:  # noqa: BLE001 - that request's answer
                fail(index, exc)
                continue
            rows.append((index, self._decoder_row(item, embeds, level)))
        return rows

    def _decoder_row(self, item: Prepared, embeds: torch.Tensor, level: CacheLevel) -> Row:
        """The decoder's row: the prompt but its last token as embeddings (images merged in), the last token as
        the id the decoder feeds on, and how its vision features were had."""
        ids = item.inputs.input_ids.to(self.device)
        return self._row(item, PromptInputs(ids[:, :-1], ids[:, -1:], {}, num_images=item.inputs.num_images,
                                            prefix_embeds=embeds[:, :-1], cache_level=level))

    # ------------------------------------------------------------ vision features

    def _cached_features(self, inputs: MiniCPMOInputs) -> torch.Tensor | None:
        if inputs.vision_key is None:
            return None
        return self.frame_cache.lookup(inputs.vision_key, inputs.vision_key, None).value

    def _encode_together(self, rows: list[MiniCPMOInputs], cached: list) -> dict[int, torch.Tensor]:
        """{row: its vision features} from ONE call of the model's vision encoder over the images of every row not
        cached (the model pads and masks slices of different sizes); {} when fewer than two rows need the encoder,
        or when that call fails: then each row encodes its own images, and a bad one fails alone."""
        need = [i for i, row in enumerate(rows) if row.num_images and cached[i] is None]
        if len(need) < 2:
            return {}
        data = {"pixel_values": [[strip.to(self.device) for strip in rows[i].pixel_values] for i in need],
                "tgt_sizes": [rows[i].tgt_sizes.to(self.device) for i in need]}
        try:
            with torch.inference_mode():
                features = self.model.get_vision_embedding(data)
        except Exception:  # noqa: BLE001 - retried row by row, where the failing row fails alone
            log.warning("encoding %d rows' images together failed; encoding them one by one", len(need),
                        exc_info=True)
            return {}
        return dict(zip(need, features))

    def _embed(self, inputs: MiniCPMOInputs, cached: torch.Tensor | None,
               encoded: torch.Tensor | None = None) -> tuple[torch.Tensor, CacheLevel]:
        """The row's (1, n, hidden) inputs_embeds from the model's own get_vllm_embedding, and how its vision
        features were had: EXACT (cached) | MISS (encoded and kept) | OFF (cache off) | NONE (no image).
        `encoded`: this row's features when they were encoded together with other rows'."""
        data: dict[str, Any] = {"input_ids": inputs.input_ids.to(self.device), "image_bound": [inputs.image_bound]}
        features = cached if cached is not None else encoded
        if features is not None:
            data["vision_hidden_states"] = [features]
        else:
            data["pixel_values"] = [[strip.to(self.device) for strip in inputs.pixel_values]]
            data["tgt_sizes"] = [inputs.tgt_sizes.to(self.device) if torch.is_tensor(inputs.tgt_sizes) else []]
        with torch.inference_mode():
            embeds, vision_hidden_states = self.model.get_vllm_embedding(data)
        if not inputs.num_images:
            return embeds, CacheLevel.NONE
        if cached is not None:
            return embeds, CacheLevel.EXACT
        if inputs.vision_key is None:
            return embeds, CacheLevel.OFF
        features = vision_hidden_states[0]
        self.frame_cache.put(inputs.vision_key, inputs.vision_key, None, features, tensor_nbytes(features))
        return embeds, CacheLevel.MISS


def make_engine(loaded: "LoadedModel", options: EngineOptions) -> MiniCPMOEngine:
    """FAMILIES' engine factory; the frame budget holds vision features (this engine's exact level)."""
    return MiniCPMOEngine.from_loaded(loaded, options, vision_cache_bytes=options.kv_cache_bytes)


def chat_messages(messages: tuple[Message, ...],
                  escape_text: Callable[[str], str] = lambda text: text) -> list[dict[str, str]]:
    """Protocol messages -> the message list chat() builds: text parts and image placeholders, one per line.
    Text parts go through `escape_text`, so only the placeholders put here for images are placeholders."""
    return [{"role": m.role,
             "content": "\n".join(IMAGE_PLACEHOLDER if isinstance(p, ImagePart) else escape_text(p)
                                  for p in m.parts)}
            for m in messages]


def terminator_ids(model: Any, tokenizer: Any) -> list[int]:
    """The ids that end a reply: the model's `terminators` (token strings), else the tokenizer's EOS."""
    ids = [tokenizer.convert_tokens_to_ids(t) for t in getattr(model, "terminators", [])]
    ids = [i for i in ids if isinstance(i, int) and i != tokenizer.unk_token_id]
    return ids or [tokenizer.eos_token_id]
