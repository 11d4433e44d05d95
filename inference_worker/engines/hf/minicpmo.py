"""Adapter for MiniCPM-o 4.5 (`openbmb/MiniCPM-o-4_5`), which ships its own modeling code.

Loads vision only (`init_vision=True, init_audio=False, init_tts=False`) through `AutoModel` with
`trust_remote_code=True`. A request becomes the messages `model.chat` takes (content lists of PIL images
and strings); the prompt and inputs are prepared the way `chat` prepares them (its chat template, its
processor, `<image>./</image>` placeholders), then `model.generate(...)` is called directly: its extra
keywords (sampling, `max_new_tokens`, `logits_processor`) reach the inner LLM's generate. `chat` itself
keeps only a fixed set of sampling keywords (a grammar processor would be dropped), defaults to beam
search when not sampling, and returns no token ids — hence generate.

Vision features are reused at the exact level: the encoder's output for a request's images
(`vision_hidden_states`, from the model's own `get_vllm_embedding`) is kept in a FrameCache keyed by a hash of
the preprocessed pixels and the model name, and handed back to `generate(vision_hidden_states=...)`, which then
skips the vision encoder. The language model still prefills the whole prompt (this engine keeps no prefix KV).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from transformers import LogitsProcessorList

from inference_worker.engines.base import Engine, EngineStats, Prepared
from inference_worker.engines.hf.sampling import finish_reason, generate_kwargs, seed_generation, trim_at_eos
from inference_worker.engines.hf.special_tokens import escaper_for
from inference_worker.engines.hf.engine import apply_num_threads, grammar_facts, release_cuda_cache
from inference_worker.engines.hf.frame_cache import FrameCache, content_key, tensor_nbytes
from inference_worker.protocol import ChatRequest, Completion, ImagePart, Message

if TYPE_CHECKING:
    from PIL.Image import Image

    from inference_worker.engines.hf.loading import LoadedModel
    from inference_worker.engines.hf.grammar import SchemaGrammars

IMAGE_PLACEHOLDER = "<image>./</image>"   # what chat() puts where an image was
MAX_INPUT_TOKENS = 8192                   # chat()'s default max_inp_length
DEFAULT_VISION_CACHE_BYTES = 256 * 1024 * 1024   # ~50 frames of MiniCPM-o 4.5 features (10 slices x 64 x 4096, bf16)


def load_minicpmo_parts(path: Path, *, dtype, attn_implementation: str, device, step: Callable[[], None]):
    """The processor (with its tokenizer) and the vision+language part of the model, on `device`."""
    from transformers import AutoModel, AutoProcessor

    processor = AutoProcessor.from_pretrained(path, trust_remote_code=True)
    step()
    try:
        model = AutoModel.from_pretrained(path, trust_remote_code=True, dtype=dtype,
                                          attn_implementation=attn_implementation,
                                          init_vision=True, init_audio=False, init_tts=False)
    except (AttributeError, TypeError, NameError) as exc:     # remote code written for another transformers
        raise _remote_code_error(exc) from None
    step()
    model = model.to(device).eval()
    model.processor = processor          # chat() would otherwise load it again from config._name_or_path
    step()
    return model, processor


def _remote_code_error(exc: Exception):
    import transformers

    from inference_worker.engines.hf.loading import ModelLoadError
    return ModelLoadError(
        f"MiniCPM-o's own model code failed under transformers {transformers.__version__}: {exc}. "
        "The official code targets transformers 4.51; use a revision ported to transformers 5 (see the "
        "model page), or openbmb/MiniCPM-V-4.6, which transformers supports natively.")


class MiniCPMOEngine(Engine):
    kind = "minicpmo"

    def __init__(self, model: Any, processor: Any, *, model_name: str, use_grammar: bool = True,
                 num_threads: int | None = None, vision_cache_bytes: int = DEFAULT_VISION_CACHE_BYTES):
        self.model = model
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.model_name = model_name
        self.use_grammar = use_grammar
        self.num_threads = num_threads
        self.eos_token_ids = terminator_ids(model, self.tokenizer)
        self.grammars: SchemaGrammars | None = None
        #: request text -> text that cannot spell `<image>./</image>`, `<|im_start|>`... (see special_tokens.py)
        self.escape_text = escaper_for(self.tokenizer, processor)
        #: vision_hidden_states per set of preprocessed images (exact level only; 0 bytes = off)
        self.frame_cache = FrameCache(vision_cache_bytes, similar_threshold=None)

    @classmethod
    def from_loaded(cls, loaded: "LoadedModel", **options: Any) -> "MiniCPMOEngine":
        return cls(loaded.model, loaded.processor, model_name=loaded.name, **options)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def prepare(self, request: ChatRequest, images: list["Image"]) -> Prepared:
        """Template, processor and the frame's vision key, on a preprocessing thread."""
        msgs = chat_messages(request.messages, self.escape_text)
        prompt = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                                    enable_thinking=False)
        rgb = [img if img.mode == "RGB" else img.convert("RGB") for img in images]
        inputs = self.processor([prompt], [rgb], return_tensors="pt", max_length=MAX_INPUT_TOKENS)
        vision_key = self._vision_key(inputs) if rgb and self.frame_cache.is_enabled else None
        return Prepared(request, images, (inputs, vision_key))

    def complete(self, request: ChatRequest, images: list["Image"]) -> Completion:
        return self.complete_prepared(self.prepare(request, images))

    def complete_prepared(self, item: Prepared) -> Completion:
        """One request through the model's own generate (this engine answers a batch row by row)."""
        apply_num_threads(self.num_threads)
        request, (inputs, vision_key) = item.request, item.inputs
        inputs = inputs.to(self.device)
        inputs.pop("image_sizes", None)
        grammar = self._grammar_processor(request)
        seed_generation(request.sampling)
        with torch.inference_mode():
            vision_hidden_states, reuse = self._vision_features(inputs, vision_key, has_images=bool(item.images))
            _, outputs = self.model.generate(
                **inputs, tokenizer=self.tokenizer, stream=False, vision_hidden_states=vision_hidden_states,
                **generate_kwargs(request.sampling),
                logits_processor=LogitsProcessorList([grammar] if grammar else []))
        # generate starts from inputs_embeds, so sequences hold only the generated tokens
        token_ids, is_eos = trim_at_eos(outputs.sequences[0].tolist(), self.eos_token_ids)
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        return Completion(text=text, finish_reason=finish_reason(is_eos),
                          prompt_tokens=int(inputs["input_ids"].shape[1]), completion_tokens=len(token_ids),
                          extra={**grammar_facts(grammar), "kv_cache": reuse})

    def _vision_key(self, inputs) -> bytes:
        """The exact-level key of a request's images: its preprocessed pixels (hashed on the CPU, before they move
        to the device) and the model."""
        return content_key(self.model_name, inputs["pixel_values"], inputs["tgt_sizes"])

    def _vision_features(self, inputs, key: bytes | None, *, has_images: bool) -> tuple[Any, str]:
        """(vision_hidden_states for generate, or None to let it run the vision encoder; how they were reused:
        "exact" | "miss" | "off" (cache off) | "none" (request without images))."""
        if not has_images:
            return None, "none"
        if key is None:
            return None, "off"
        cached = self.frame_cache.lookup(key, key, None).value
        if cached is not None:
            return cached, "exact"
        data = {name: inputs[name] for name in ("input_ids", "pixel_values", "tgt_sizes", "image_bound")}
        _, vision_hidden_states = self.model.get_vllm_embedding(data)        # runs the vision encoder once
        self.frame_cache.put(key, key, None, vision_hidden_states, tensor_nbytes(vision_hidden_states))
        return vision_hidden_states, "miss"

    def stats(self) -> EngineStats:
        cache = self.frame_cache
        if cache is None:
            return EngineStats(num_cuda_empty_cache_calls=self.num_cuda_empty_cache_calls)
        return EngineStats(num_cuda_empty_cache_calls=self.num_cuda_empty_cache_calls, kv_bytes=cache.num_bytes,
                           kv_entries=cache.num_entries, kv_evictions=cache.num_evictions)

    def after_call(self) -> None:
        self.num_cuda_empty_cache_calls += release_cuda_cache()

    def close(self) -> None:
        self.frame_cache.clear()
        self.model = None
        self.grammars = None
        self.num_cuda_empty_cache_calls += release_cuda_cache()

    def _grammar_processor(self, request: ChatRequest):
        if request.json_schema is None or not self.use_grammar:
            return None
        if self.grammars is None:
            from inference_worker.engines.hf.grammar import SchemaGrammars
            vocab_size = self.model.llm.get_output_embeddings().weight.shape[0]
            self.grammars = SchemaGrammars(self.tokenizer, vocab_size=vocab_size, eos_token_ids=self.eos_token_ids)
        return self.grammars.logits_processor(request.json_schema)


def make_engine(loaded: "LoadedModel", options) -> MiniCPMOEngine:
    """FAMILIES' engine factory; the frame budget holds vision features (this engine's exact level)."""
    return MiniCPMOEngine.from_loaded(loaded, use_grammar=options.use_grammar, num_threads=options.num_threads,
                                      vision_cache_bytes=options.kv_cache_bytes)


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
