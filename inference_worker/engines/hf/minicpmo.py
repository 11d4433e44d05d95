"""Adapter for MiniCPM-o 4.5 (`openbmb/MiniCPM-o-4_5`), which ships its own modeling code: vision only, batched.

**Loading on transformers 5.** The official remote code (pinned to transformers 4.51) does not load on 5.x as is;
read in OpenBMB/MiniCPM-o-Demo (MiniCPMO45/) and run on a tiny random instance here, it fails in four places,
and `remote_code_compat()`, `_with_post_init` and `restore_position_tables` pass through them while loading:
1. `modeling_navit_siglip.py` imports `transformers.modeling_attn_mask_utils` (removed in 5; the config file
   imports it, so `AutoProcessor.from_pretrained` already fails): a module of that name is provided with the one
   function it imports, `_prepare_4d_attention_mask` (the additive padding mask SigLIP uses for mixed-size slices).
2. transformers' `check_imports` demands `flag_gems`, `librosa`, `soundfile`, which the code imports only behind
   `USE_FLAGOS=1`, for reference audio and for writing speech: they are left out of the check.
3. `MiniCPMO.__init__` never calls `post_init()`, which 5.x's `from_pretrained` needs (`all_tied_weights_keys`):
   the model class is loaded through a subclass that calls it.
4. 5.x builds the model on the meta device and hands every non-persistent buffer to `_init_weights`; the
   resampler's 2-D sin-cos `pos_embed` is one that Qwen3's init does not know, so it is left uninitialised
   memory (silently wrong vision features): it is recomputed with the resampler's own `_set_2d_pos_cache`.
The shim module is removed again after loading (the loaded code keeps its reference). With these, the whole
vision-only path of the official code was run on transformers 5.24 (a tiny random instance of it: processor,
`get_vllm_embedding`, the LM): see the README's MiniCPM-o section.

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

import contextlib
import importlib.util
import itertools
import logging
import sys
import threading
import types
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch

from inference_worker.engines.base import Engine, EngineStats, OnDone, Prepared, TakeMoreItems, run_one
from inference_worker.engines.hf.batch_decode import BatchDecoder, can_merge_caches
from inference_worker.engines.hf.rows import PromptInputs, Row, RowResult
from inference_worker.engines.hf.torch_utils import apply_num_threads, release_cuda_cache
from inference_worker.engines.hf.frame_cache import FrameCache, content_key, tensor_nbytes
from inference_worker.engines.hf.sampling import finish_reason, trim_at_eos
from inference_worker.engines.hf.special_tokens import escaper_for
from inference_worker.engines.hf.text_stream import text_stream
from inference_worker.engines.prompt_bounds import PromptBounds, context_tokens_of
from inference_worker.errors import PromptTooLongError
from inference_worker.protocol import ChatRequest, Completion, ImagePart, Message

if TYPE_CHECKING:
    from PIL.Image import Image

    from inference_worker.engines.hf.grammar import SchemaGrammars
    from inference_worker.engines.hf.loading import LoadedModel

log = logging.getLogger("deskeye.worker")

IMAGE_PLACEHOLDER = "<image>./</image>"   # what chat() puts where an image was
MAX_INPUT_TOKENS = 8192                   # chat()'s default max_inp_length (it truncates; this engine refuses)
DEFAULT_VISION_CACHE_BYTES = 256 * 1024 * 1024   # ~50 frames of MiniCPM-o 4.5 features (10 slices x 64 x 4096, bf16)
#: packages the remote code imports only on paths DeskEye never takes (FlagOS kernels, reference audio, speech out)
OPTIONAL_REMOTE_IMPORTS = frozenset({"flag_gems", "librosa", "soundfile"})
#: removed in transformers 5; the remote modeling_navit_siglip.py imports it
REMOVED_MASK_UTILS = "transformers.modeling_attn_mask_utils"


def is_minicpmo_config(config: dict[str, Any]) -> bool:
    """Whether a checkpoint's config.json is MiniCPM-o's: model_type 'minicpmo', or its own code (auto_map) names
    MiniCPMO (the AWQ build keeps both)."""
    auto_map = config.get("auto_map") or {}
    return config.get("model_type") == "minicpmo" or any("MiniCPMO" in str(v) for v in auto_map.values())


# ---------------------------------------------------------------- loading the remote code on transformers 5

def prepare_4d_attention_mask(mask: torch.Tensor, dtype: torch.dtype, tgt_len: int | None = None) -> torch.Tensor:
    """transformers 4.x's `_prepare_4d_attention_mask`: a (batch, keys) 1/0 padding mask -> the additive
    (batch, 1, queries, keys) mask: 0 where a key is attended, the dtype's minimum where it is padding."""
    batch, num_keys = mask.shape
    num_queries = num_keys if tgt_len is None else tgt_len
    keep = mask[:, None, None, :].expand(batch, 1, num_queries, num_keys).to(torch.bool)
    additive = torch.zeros((batch, 1, num_queries, num_keys), dtype=dtype, device=mask.device)
    return additive.masked_fill(~keep, torch.finfo(dtype).min)


@contextlib.contextmanager
def remote_code_compat() -> Iterator[None]:
    """While loading MiniCPM-o's remote code: provide the removed mask-utils module (only when transformers has
    none) and leave the optional packages out of transformers' import check. Both are undone on exit."""
    from transformers import dynamic_module_utils

    with _mask_utils_module(), _optional_imports_unchecked(dynamic_module_utils):
        yield


@contextlib.contextmanager
def _mask_utils_module() -> Iterator[None]:
    if importlib.util.find_spec(REMOVED_MASK_UTILS) is not None:     # transformers 4.x: the real module
        yield
        return
    shim = types.ModuleType(REMOVED_MASK_UTILS, "DeskEye's stand-in for a module transformers 5 removed")
    shim._prepare_4d_attention_mask = prepare_4d_attention_mask
    sys.modules[REMOVED_MASK_UTILS] = shim
    try:
        yield
    finally:
        if sys.modules.get(REMOVED_MASK_UTILS) is shim:
            del sys.modules[REMOVED_MASK_UTILS]


@contextlib.contextmanager
def _optional_imports_unchecked(dynamic_module_utils) -> Iterator[None]:
    get_imports = dynamic_module_utils.get_imports       # check_imports looks it up at call time

    def required_imports(filename):
        return [name for name in get_imports(filename) if name not in OPTIONAL_REMOTE_IMPORTS]
    dynamic_module_utils.get_imports = required_imports
    try:
        yield
    finally:
        dynamic_module_utils.get_imports = get_imports


def _with_post_init(model_class: type) -> type:
    """`model_class` whose __init__ ends with `post_init()` when the remote one did not call it."""
    class VisionOnly(model_class):
        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            if not hasattr(self, "all_tied_weights_keys"):
                self.post_init()
    VisionOnly.__name__, VisionOnly.__qualname__ = model_class.__name__, model_class.__qualname__
    VisionOnly.__module__ = model_class.__module__
    return VisionOnly


def restore_position_tables(model: Any) -> int:
    """Recompute the resamplers' 2-D position tables (non-persistent buffers that transformers 5's from_pretrained
    leaves uninitialised), on the CPU as at construction; returns how many were restored."""
    resamplers = [m for m in model.modules() if callable(getattr(m, "_set_2d_pos_cache", None))]
    for resampler in resamplers:
        resampler._set_2d_pos_cache(resampler.max_size, device="cpu")
    if hasattr(model, "resampler") and not resamplers:
        raise AttributeError("the resampler has no _set_2d_pos_cache to rebuild its position table with")
    return len(resamplers)


def load_minicpmo_parts(path: Path, *, dtype, attn_implementation: str, device, step: Callable[[], None]):
    """The processor (with its tokenizer) and the vision+language part of the model, on `device`."""
    from transformers import AutoConfig, AutoProcessor
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    with remote_code_compat():
        try:
            processor = AutoProcessor.from_pretrained(path, trust_remote_code=True)
            step()
            config = AutoConfig.from_pretrained(path, trust_remote_code=True)
            model_class = _with_post_init(get_class_from_dynamic_module(config.auto_map["AutoModel"], path))
            model = model_class.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation,
                                                init_vision=True, init_audio=False, init_tts=False,
                                                device_map=str(device) if device.type == "cuda" else None)  # ~19 GB
            restore_position_tables(model)
        except (ImportError, AttributeError, TypeError, NameError, KeyError) as exc:   # code for another transformers
            raise _remote_code_error(path, exc) from None
    step()
    model = model.to(device).eval()
    model.processor = processor          # chat() would otherwise load it again from config._name_or_path
    step()
    return model, processor


def _remote_code_error(path: Path, exc: Exception):
    import transformers

    from inference_worker.engines.hf.loading import ModelLoadError
    what = " ".join(f"{type(exc).__name__}: {exc}".split())
    return ModelLoadError(
        f"MiniCPM-o's own model code in {path} does not load under transformers {transformers.__version__} even "
        f"with DeskEye's compatibility layer ({what}); use the official openbmb/MiniCPM-o-4_5 revision, or "
        "openbmb/MiniCPM-V-4.6, which transformers supports natively.")


# ---------------------------------------------------------------- the engine

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


class MiniCPMOEngine(Engine):
    kind = "minicpmo"
    can_batch = True

    def __init__(self, model: Any, processor: Any, *, model_name: str, use_grammar: bool = True,
                 num_threads: int | None = None, vision_cache_bytes: int = DEFAULT_VISION_CACHE_BYTES,
                 keep_logits: bool = False, max_prompt_tokens: int = 0):
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"num_threads must be at least 1 (or None for torch's default); got {num_threads}.")
        self.model = model
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.model_name = model_name
        self.use_grammar = use_grammar
        self.num_threads = num_threads
        self.eos_token_ids = terminator_ids(model, self.tokenizer)
        self.grammars: SchemaGrammars | None = None
        self._grammars_lock = threading.Lock()
        #: request text -> text that cannot spell `<image>./</image>`, `<|im_start|>`... (see special_tokens.py)
        self.escape_text = escaper_for(self.tokenizer, processor)
        #: vision_hidden_states per set of preprocessed images (exact level only; 0 bytes = off)
        self.frame_cache = FrameCache(vision_cache_bytes, similar_threshold=None)
        #: the language model's context, or less (--max-prompt-tokens); MAX_INPUT_TOKENS is checked besides
        self.bounds = PromptBounds(context_tokens_of(model.llm.config), max_prompt_tokens)
        self.decoder = BatchDecoder(model.llm, eos_token_ids=self.eos_token_ids, grammars=self._schema_grammars,
                                    can_merge=can_merge_caches(model.llm), keep_logits=keep_logits,
                                    max_context_tokens=self.bounds.context_tokens)

    @classmethod
    def from_loaded(cls, loaded: "LoadedModel", **options: Any) -> "MiniCPMOEngine":
        return cls(loaded.model, loaded.processor, model_name=loaded.name, **options)

    @property
    def device(self) -> torch.device:
        return self.model.device

    # ------------------------------------------------------------ the contract

    def prepare(self, request: ChatRequest, images: list["Image"]) -> Prepared:
        """Template, processor and the frame's vision key, on a preprocessing thread (as chat() prepares). A prompt
        over MAX_INPUT_TOKENS or the model's `bounds` is refused (PromptTooLongError)."""
        self.bounds.check_text(request)
        msgs = chat_messages(request.messages, self.escape_text)
        prompt = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                                    enable_thinking=False)
        rgb = [img if img.mode == "RGB" else img.convert("RGB") for img in images]
        batch = self.processor([prompt], [rgb], None, None, max_slice_nums=None, use_image_id=None,
                               return_tensors="pt", max_length=None)
        input_ids = batch["input_ids"].long()
        num_tokens = int(input_ids.shape[1])
        if num_tokens > MAX_INPUT_TOKENS:
            raise PromptTooLongError(f"The prompt is {num_tokens} tokens long, {num_tokens - MAX_INPUT_TOKENS} more "
                                     f"than MiniCPM-o's {MAX_INPUT_TOKENS}: send fewer or smaller images, a shorter "
                                     "question or fewer earlier turns.", num_tokens=num_tokens,
                                     max_tokens=MAX_INPUT_TOKENS)
        self.bounds.check_tokens(num_tokens, request)
        inputs = MiniCPMOInputs(input_ids, batch["pixel_values"][0], batch["tgt_sizes"][0], batch["image_bound"][0],
                                num_images=len(rgb), vision_key=None)
        if rgb and self.frame_cache.is_enabled:
            inputs.vision_key = content_key(self.model_name, inputs.pixel_values, inputs.tgt_sizes)
        if request.json_schema is not None and self.use_grammar:
            inputs.grammar = self._schema_grammars().matcher(request.json_schema)   # GrammarError: this row's 400
        return Prepared(request, images, inputs)

    def run_batch(self, items: Sequence[Prepared], on_done: OnDone, take_more: TakeMoreItems | None = None) -> None:
        """Embed every row (one vision-encoder call for the frames not cached), then decode them together; rows
        `take_more(num_live)` hands over between steps are embedded and join, numbered after `items`."""
        apply_num_threads(self.num_threads)
        numbers = itertools.count()
        reuse: dict[int, str] = {}                   # per row index: how its vision features were had

        def rows_of(batch: Sequence[Prepared]) -> list[tuple[int, Row]]:
            indices = [next(numbers) for _ in batch]
            cached = [self._cached_features(item.inputs) for item in batch]
            encoded = self._encode_together([item.inputs for item in batch], cached)
            rows = []
            for position, (index, item) in enumerate(zip(indices, batch)):
                try:
                    embeds, reuse[index] = self._embed(item.inputs, cached[position], encoded.get(position))
                except Exception as exc:  # noqa: BLE001 - a row the model cannot embed fails alone
                    _answer(on_done, index, exc)
                    continue
                rows.append((index, self._decoder_row(item, embeds)))
            return rows

        def done(index: int, result: RowResult | Exception) -> None:
            on_done(index, result if isinstance(result, Exception) else self._completion(result, reuse[index]))

        first = rows_of(items)
        more = None if take_more is None else (lambda num_live: rows_of(take_more(num_live)))
        self.decoder.run_indexed(first, done, more)

    def _decoder_row(self, item: Prepared, embeds: torch.Tensor) -> Row:
        """The decoder's row: the prompt but its last token as embeddings (images merged in), the last token as
        the id the decoder feeds on, a fresh copy of the compiled grammar, the client's cancel event and stream."""
        ids = item.inputs.input_ids.to(self.device)
        prompt = PromptInputs(ids[:, :-1], ids[:, -1:], {}, num_images=item.inputs.num_images,
                              prefix_embeds=embeds[:, :-1])
        grammar = item.inputs.grammar.deep_copy() if item.inputs.grammar is not None and self.use_grammar else None
        return Row(prompt, item.request.sampling, grammar, item.cancelled,
                   on_token=text_stream(self.tokenizer, self.eos_token_ids, item.on_text))

    def complete(self, request: ChatRequest, images: list["Image"]) -> Completion:
        return run_one(self, self.prepare(request, images))

    def stats(self) -> EngineStats:
        cache, decoder = self.frame_cache, self.decoder
        decoding = {} if decoder is None else dict(live_rows=decoder.live_rows, num_decode_steps=decoder.num_steps,
                                                   num_row_steps=decoder.num_row_steps)
        return EngineStats(num_cuda_empty_cache_calls=self.num_cuda_empty_cache_calls, kv_bytes=cache.num_bytes,
                           kv_entries=cache.num_entries, kv_evictions=cache.num_evictions, **decoding)

    def after_call(self) -> None:
        self.num_cuda_empty_cache_calls += release_cuda_cache()

    def close(self) -> None:
        self.frame_cache.clear()
        self.model = self.decoder = None
        self.grammars = None
        self.num_cuda_empty_cache_calls += release_cuda_cache()

    # ------------------------------------------------------------ helpers

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
               encoded: torch.Tensor | None = None) -> tuple[torch.Tensor, str]:
        """The row's (1, n, hidden) inputs_embeds from the model's own get_vllm_embedding, and how its vision
        features were had: "exact" (cached) | "miss" (encoded and kept) | "off" (cache off) | "none" (no image).
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
            return embeds, "none"
        if cached is not None:
            return embeds, "exact"
        if inputs.vision_key is None:
            return embeds, "off"
        features = vision_hidden_states[0]
        self.frame_cache.put(inputs.vision_key, inputs.vision_key, None, features, tensor_nbytes(features))
        return embeds, "miss"

    def _completion(self, result: RowResult, vision_reuse: str) -> Completion:
        token_ids, is_eos = trim_at_eos(result.token_ids, self.eos_token_ids)
        extra: dict[str, Any] = {"constrained": result.is_constrained, "kv_cache": vision_reuse,
                                 "batch_size": result.batch_size,
                                 "timing": {"ttft_ms": round(result.ttft_s * 1000, 3),
                                            "decode_ms": round(result.decode_s * 1000, 3)}}
        if result.is_constrained:
            extra["grammar_ms"] = round(result.grammar_s * 1000, 3)
        return Completion(text=self.tokenizer.decode(token_ids, skip_special_tokens=True),
                          finish_reason=finish_reason(is_eos), prompt_tokens=result.prompt_tokens,
                          completion_tokens=len(token_ids), extra=extra)

    def _schema_grammars(self) -> "SchemaGrammars":
        """The tokenizer's grammar compiler, made on first use (by a preprocessing thread: hence the lock)."""
        with self._grammars_lock:
            if self.grammars is None:
                from inference_worker.engines.hf.grammar import SchemaGrammars
                vocab_size = self.model.llm.get_output_embeddings().weight.shape[0]
                self.grammars = SchemaGrammars(self.tokenizer, vocab_size=vocab_size,
                                               eos_token_ids=self.eos_token_ids)
            return self.grammars


def _answer(on_done: OnDone, index: int, answer: "Completion | Exception") -> None:
    """on_done for one row; a callback that raises is that row's problem, not its neighbours'."""
    try:
        on_done(index, answer)
    except Exception:  # noqa: BLE001
        log.exception("the completion callback of batch row %d failed; the other rows go on", index)


def make_engine(loaded: "LoadedModel", options) -> MiniCPMOEngine:
    """FAMILIES' engine factory; the frame budget holds vision features (this engine's exact level)."""
    return MiniCPMOEngine.from_loaded(loaded, use_grammar=options.use_grammar, num_threads=options.num_threads,
                                      vision_cache_bytes=options.kv_cache_bytes,
                                      max_prompt_tokens=options.max_prompt_tokens)


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
