"""DeskEye's own decode loop over the exported IR parts (what openvino_genai's VLMPipeline does inside, plus
llguidance masks, which its structured output lacks: it did not hold DeskEye's schema).

One row at a time (the CPU runs one request at full speed; rows do not batch here). Per request: the prompt's
token embeddings (text embeddings model), the image features (vision model, or the VisionCache) written over the
image tokens, one prefill of the stateful language model (its KV cache lives in the infer request's state, u8), then
per token: the grammar masks the logits (GrammarBatch.apply), a token is picked (argmax or TokenSampler), the
grammar advances, and the token's embedding is fed back. The row stops at EOS, max_tokens or when cancelled.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from inference_worker.engines.base import RowCancelled
from inference_worker.engines.hf.sampling import TokenSampler
from inference_worker.engines.openvino.vision_cache import VisionCache
from inference_worker.protocol import SamplingParams

#: a text-embedding table at most this large is read once and indexed per token, instead of one infer per token
MAX_EMBEDDING_TABLE_BYTES = 64 * 2**20


@dataclass
class IRPrompt:
    """One request made ready off the model thread: token ids, preprocessed pixels, its frame key, its grammar."""
    input_ids: np.ndarray                    # (1, L) int64
    pixel_values: np.ndarray | None = None   # (num_images, 3, H, W) float32
    frame_key: str | None = None
    matcher: Any = None                      # an llguidance matcher, or None (free text)


@dataclass
class DecodeResult:
    token_ids: list[int]
    prompt_tokens: int
    is_constrained: bool
    vision_cached: bool
    ttft_s: float
    decode_s: float
    grammar_s: float
    logits: list[np.ndarray] = field(default_factory=list)   # per step, when keep_logits (tests)


class IRDecoder:
    """Drives the compiled language, text-embedding and vision parts. Used by the model thread only."""

    def __init__(self, language: Any, text_embeddings: Any, vision: Any, *, image_token_id: int,
                 eos_token_ids: list[int], grammars: Any, vision_cache: VisionCache | None,
                 keep_logits: bool = False):
        self.language_request = language.create_infer_request()
        self.embed_request = text_embeddings.create_infer_request()
        self.vision_request = vision.create_infer_request()
        self.image_token_id = image_token_id
        self.eos_token_ids = eos_token_ids
        self.grammars = grammars             # () -> SchemaGrammars
        self.vision_cache = vision_cache
        self.keep_logits = keep_logits
        self.embedding_table = self._embedding_table(language)
        self.num_steps = 0

    def decode(self, prompt: IRPrompt, sampling: SamplingParams, cancelled: threading.Event) -> DecodeResult:
        started = time.perf_counter()
        embeds, vision_cached = self._prompt_embeddings(prompt)
        length = embeds.shape[1]
        logits = self._forward(embeds, np.arange(length, dtype=np.int64)[None], length, reset=True)
        grammar, row = self._grammar_row(prompt.matcher)
        sampler = TokenSampler(sampling)
        result = DecodeResult([], length, prompt.matcher is not None, vision_cached, 0.0, 0.0, 0.0)
        try:
            self._loop(logits, length, sampling, sampler, grammar, row, cancelled, result, started)
        finally:
            if grammar is not None:
                result.grammar_s = grammar.elapsed_s
                grammar.close()
        return result

    # ------------------------------------------------------------ the loop

    def _loop(self, logits, length, sampling, sampler, grammar, row, cancelled, result, started) -> None:
        first_token_at = None
        for step in range(sampling.max_tokens):
            if cancelled.is_set():
                raise RowCancelled()
            token = self._pick(logits, sampler, grammar, row)
            if self.keep_logits:
                result.logits.append(logits.copy())
            first_token_at = first_token_at or time.perf_counter()
            result.token_ids.append(token)
            self.num_steps += 1
            if token in self.eos_token_ids:
                break
            if grammar is not None:
                grammar.advance([row], [token])
            if step + 1 == sampling.max_tokens:
                break
            position = length + step
            logits = self._forward(self._embed([token]), np.array([[position]], dtype=np.int64), position + 1)
        result.ttft_s = (first_token_at or time.perf_counter()) - started
        result.decode_s = time.perf_counter() - started - result.ttft_s

    def _pick(self, logits: np.ndarray, sampler: TokenSampler, grammar, row: int) -> int:
        line = torch.from_numpy(logits[None])
        if grammar is None:
            return int(logits.argmax()) if sampler.is_greedy else sampler.sample(line[0])
        argmax = grammar.apply(line, [row], greedy=[sampler.is_greedy])
        return argmax[0] if sampler.is_greedy else sampler.sample(line[0])

    def _grammar_row(self, matcher) -> tuple[Any, int]:
        if matcher is None:
            return None, -1
        grammar = self.grammars().batch([])
        return grammar, grammar.add(matcher)

    # ------------------------------------------------------------ the IR parts

    def _forward(self, embeds: np.ndarray, position_ids: np.ndarray, num_positions: int, *,
                 reset: bool = False) -> np.ndarray:
        """One language-model call; the last position's logits (vocab,), float32 (a copy: the request reuses
        its output buffer)."""
        if reset:
            self.language_request.reset_state()
        self.language_request.infer({"inputs_embeds": embeds,
                                     "attention_mask": np.ones((1, num_positions), dtype=np.int64),
                                     "position_ids": position_ids, "beam_idx": np.zeros(1, dtype=np.int32)})
        return np.array(self.language_request.get_tensor("logits").data[0, -1], dtype=np.float32)

    def _prompt_embeddings(self, prompt: IRPrompt) -> tuple[np.ndarray, bool]:
        embeds = self._embed(prompt.input_ids[0].tolist())
        if prompt.pixel_values is None:
            return embeds, False
        features, cached = self._vision_features(prompt)
        is_image = prompt.input_ids[0] == self.image_token_id
        flat = features.reshape(-1, features.shape[-1])
        if int(is_image.sum()) != flat.shape[0]:
            raise ValueError(f"the prompt has {int(is_image.sum())} image tokens but the vision model gave "
                             f"{flat.shape[0]} features: the IR folder's processor and model do not match.")
        embeds[0, is_image] = flat
        return embeds, cached

    def _vision_features(self, prompt: IRPrompt) -> tuple[np.ndarray, bool]:
        cache = self.vision_cache
        if cache is not None and prompt.frame_key is not None:
            features = cache.get(prompt.frame_key)
            if features is not None:
                return features, True
        self.vision_request.infer({"pixel_values": prompt.pixel_values})
        features = np.array(self.vision_request.get_output_tensor(0).data, dtype=np.float32)
        if cache is not None and prompt.frame_key is not None:
            cache.put(prompt.frame_key, features)
        return features, False

    def _embed(self, token_ids: list[int]) -> np.ndarray:
        """(1, len, hidden) float32 embeddings of `token_ids` (a writable copy)."""
        if self.embedding_table is not None:
            return self.embedding_table[np.asarray(token_ids, dtype=np.int64)][None]
        self.embed_request.infer({"input": np.asarray([token_ids], dtype=np.int64)})
        return np.array(self.embed_request.get_output_tensor(0).data, dtype=np.float32)

    def _embedding_table(self, language: Any) -> np.ndarray | None:
        """Every token's embedding, computed once by the text-embeddings model itself, when the table is small."""
        vocab = language.output("logits").get_partial_shape()[-1]
        hidden = language.input("inputs_embeds").get_partial_shape()[-1]
        if not (vocab.is_static and hidden.is_static):
            return None
        if vocab.get_length() * hidden.get_length() * 4 > MAX_EMBEDDING_TABLE_BYTES:
            return None
        self.embed_request.infer({"input": np.arange(vocab.get_length(), dtype=np.int64)[None]})
        return np.array(self.embed_request.get_output_tensor(0).data[0], dtype=np.float32)
