"""The vision-language model engine for families transformers supports natively (Idefics3, LLaVA,
MiniCPM-V 4.6, …): chat template + processor + generate, with JSON-schema-constrained decoding.

Everything here runs on the worker's model thread: `complete`, `after_call` and `close`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from transformers import LogitsProcessorList

from inference_worker.engines.base import Engine
from inference_worker.engines.loading import LoadedModel, LoadSpec, load_model
from inference_worker.engines.sampling import (eos_token_ids, finish_reason, generate_kwargs, seed_generation,
                                               trim_at_eos)
from inference_worker.engines.special_tokens import escaper_for
from inference_worker.protocol import ChatRequest, Completion, ImagePart, Message

if TYPE_CHECKING:
    from PIL.Image import Image

    from inference_worker.grammar import SchemaGrammars


class TransformersEngine(Engine):
    kind = "transformers"

    def __init__(self, model: Any, processor: Any, *, model_name: str, use_grammar: bool = True,
                 num_threads: int | None = None):
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"num_threads must be at least 1 (or None for torch's default); got {num_threads}.")
        self.model = model
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.model_name = model_name
        self.use_grammar = use_grammar
        self.num_threads = num_threads
        self.eos_token_ids = eos_token_ids(model.generation_config, self.tokenizer)
        self.pad_token_id = self.tokenizer.pad_token_id
        if self.pad_token_id is None:
            self.pad_token_id = self.eos_token_ids[0]
        self.grammars: SchemaGrammars | None = None
        #: request text -> text the processor and tokenizer read as text only (see special_tokens.py)
        self.escape_text = escaper_for(self.tokenizer, processor)

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, **options: Any) -> "TransformersEngine":
        return cls(loaded.model, loaded.processor, model_name=loaded.name, **options)

    @property
    def device(self) -> torch.device:
        return self.model.device

    # ------------------------------------------------------------ the contract

    def complete(self, request: ChatRequest, images: list["Image"]) -> Completion:
        apply_num_threads(self.num_threads)
        prompt = self.processor.apply_chat_template(template_messages(request.messages, self.escape_text),
                                                    add_generation_prompt=True, tokenize=False)
        inputs = self._model_inputs(prompt, images)
        prompt_len = inputs["input_ids"].shape[1]
        grammar = self._grammar_processor(request)
        seed_generation(request.sampling)
        with torch.inference_mode():
            output = self.model.generate(
                **inputs, **generate_kwargs(request.sampling), eos_token_id=self.eos_token_ids,
                pad_token_id=self.pad_token_id, logits_processor=LogitsProcessorList([grammar] if grammar else []))
        token_ids, is_eos = trim_at_eos(output[0, prompt_len:].tolist(), self.eos_token_ids)
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        return Completion(text=text, finish_reason=finish_reason(is_eos), prompt_tokens=prompt_len,
                          completion_tokens=len(token_ids), extra=grammar_facts(grammar))

    def after_call(self) -> None:
        self.num_cuda_empty_cache_calls += release_cuda_cache()

    def close(self) -> None:
        self.model = None
        self.grammars = None
        self.num_cuda_empty_cache_calls += release_cuda_cache()

    # ------------------------------------------------------------ helpers

    def _model_inputs(self, prompt: str, images: list["Image"]) -> dict[str, torch.Tensor]:
        rgb = [img if img.mode == "RGB" else img.convert("RGB") for img in images]
        batch = self.processor(text=[prompt], images=[rgb] if rgb else None, return_tensors="pt")
        inputs = {}
        for key, value in batch.items():
            if torch.is_floating_point(value):
                value = value.to(self.model.dtype)
            inputs[key] = value.to(self.device)
        return inputs

    def _grammar_processor(self, request: ChatRequest):
        if request.json_schema is None or not self.use_grammar:
            return None
        if self.grammars is None:
            from inference_worker.grammar import SchemaGrammars
            vocab_size = self.model.get_output_embeddings().weight.shape[0]
            self.grammars = SchemaGrammars(self.tokenizer, vocab_size=vocab_size, eos_token_ids=self.eos_token_ids)
        return self.grammars.logits_processor(request.json_schema)


def template_messages(messages: tuple[Message, ...],
                      escape_text: Callable[[str], str] = lambda text: text) -> list[dict[str, Any]]:
    """Protocol messages -> chat-template messages; each image becomes the template's image placeholder and
    each text part goes through `escape_text` (so it cannot spell the model's special tokens)."""
    return [{"role": m.role,
             "content": [{"type": "image"} if isinstance(p, ImagePart) else {"type": "text", "text": escape_text(p)}
                         for p in m.parts]}
            for m in messages]


def grammar_facts(grammar) -> dict[str, Any]:
    """Completion.extra: whether the output was constrained, and the time the grammar took."""
    if grammar is None:
        return {"constrained": False}
    return {"constrained": True, "grammar_ms": round(grammar.elapsed_s * 1000, 3)}


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


def load_transformers_engine(model: str, *, device: str = "auto", dtype: str = "auto", use_grammar: bool = True,
                             num_threads: int | None = None, progress: bool = True) -> Engine:
    """Load `model` (folder or Hub id) and wrap it in the engine for its family.

    Raises ModelLoadError with a user-facing message for anything the user can fix.
    """
    apply_num_threads(num_threads)
    loaded = load_model(LoadSpec(model, device, dtype), progress=progress)
    if loaded.family == "minicpmo":
        from inference_worker.engines.minicpmo import MiniCPMOEngine
        return MiniCPMOEngine.from_loaded(loaded, use_grammar=use_grammar, num_threads=num_threads)
    return TransformersEngine.from_loaded(loaded, use_grammar=use_grammar, num_threads=num_threads)
