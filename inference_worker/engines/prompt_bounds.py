"""How long a prompt may be: the model's context, or less with --max-prompt-tokens.

A prompt longer than the model reads costs the model thread its whole prefill before anything can go wrong (64,000
tokens took 15 s on a tiny model whose context is 1,024), so `prepare` checks it off the model thread and refuses it
with a 400 that names the numbers and what to shorten. Two checks, the cheap one first:

1. the request's text, in characters, before anything tokenizes it: a chat template and a tokenizer cost time in
   proportion to the text (200 KB of combining accents: 2 s of a preprocessing thread, for 400,000 tokens), and
   no text longer than `MAX_CHARS_PER_TOKEN` characters per allowed token can fit;
2. the prompt's tokens, images included, once the processor made them.

The prompt must leave room for the answer: the limit is the context less the request's max_tokens, or less a
quarter of the context when max_tokens asks for more (the decoder stops an answer at the end of the context, with
finish_reason "length"), and never more than --max-prompt-tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inference_worker.errors import PromptTooLongError
from inference_worker.protocol import ChatRequest

#: text longer than this many characters per allowed token is refused before tokenizing; ordinary text of any
#: script takes 1-6 characters per token, so only text no prompt limit could hold is refused this way
MAX_CHARS_PER_TOKEN = 16
#: the prompt limit when neither the model's config nor --max-prompt-tokens gives one
FALLBACK_CONTEXT_TOKENS = 32_768
#: config attributes that hold a model's context length, in the order they are looked for
CONTEXT_ATTRIBUTES = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
SHORTEN = "shorten the question or the earlier turns, or send fewer or smaller images"


@dataclass(frozen=True)
class PromptBounds:
    """The prompt limits of one engine's model. `context_tokens`: the model's context (None when its config names
    none); `max_prompt_tokens`: the worker's --max-prompt-tokens (0 = the context alone)."""
    context_tokens: int | None = None
    max_prompt_tokens: int = 0

    def __post_init__(self):
        if self.context_tokens is not None and self.context_tokens < 2:
            raise ValueError(f"context_tokens must be at least 2 (or None: unknown); got {self.context_tokens}.")
        if self.max_prompt_tokens < 0:
            raise ValueError(f"max_prompt_tokens must be >= 0 (0 = the context); got {self.max_prompt_tokens}.")

    @property
    def most_prompt_tokens(self) -> int:
        """The longest prompt any request may have (one that asks for a one-token answer)."""
        return self.limit(1)

    @property
    def max_text_chars(self) -> int:
        """The most characters of text a request may carry (checked before tokenizing)."""
        return self.most_prompt_tokens * MAX_CHARS_PER_TOKEN

    def answer_room(self, max_tokens: int) -> int:
        """Tokens of the context kept for the answer: max_tokens, but at most a quarter of the context."""
        return max(1, min(max_tokens, (self.context_tokens or 0) // 4))

    def limit(self, max_tokens: int) -> int:
        """The most prompt tokens a request asking for `max_tokens` may have."""
        return self._limit(max_tokens)[0]

    def check_text(self, request: ChatRequest) -> None:
        """PromptTooLongError when the request's text cannot fit, whatever it tokenizes to (runs before the
        template and the tokenizer do)."""
        num_chars = request_text_chars(request)
        max_chars = self.max_text_chars
        if num_chars > max_chars:
            _, source, _ = self._limit(1)
            raise PromptTooLongError(
                f"The request's text is {num_chars:,} characters, {num_chars - max_chars:,} over the {max_chars:,} "
                f"this worker reads: {MAX_CHARS_PER_TOKEN} characters for each of the {self.most_prompt_tokens:,} "
                f"tokens a prompt may have ({source}). Shorten the question or the earlier turns.",
                num_chars=num_chars, max_chars=max_chars)

    def check_tokens(self, num_tokens: int, request: ChatRequest) -> None:
        """PromptTooLongError naming the prompt's tokens, the limit and by how much it is over."""
        limit, source, room = self._limit(request.sampling.max_tokens)
        if num_tokens <= limit:
            return
        why = source if room is None else f"{source} less {room:,} kept for the answer"
        fewer = "" if room is None else ", or ask for fewer max_tokens"
        raise PromptTooLongError(
            f"The prompt is {num_tokens:,} tokens, {num_tokens - limit:,} over the {limit:,} this worker accepts "
            f"({why}): {SHORTEN}{fewer}.", num_tokens=num_tokens, max_tokens=limit)

    def _limit(self, max_tokens: int) -> tuple[int, str, int | None]:
        """The limit for a request asking for `max_tokens`, where it comes from in words, and the answer's room
        when the context is what limits it (None otherwise)."""
        candidates: list[tuple[int, str, int | None]] = []
        if self.context_tokens is not None:
            room = self.answer_room(max_tokens)
            candidates.append((self.context_tokens - room, f"the model's context of {self.context_tokens:,} tokens",
                               room))
        if self.max_prompt_tokens:
            candidates.append((self.max_prompt_tokens, f"--max-prompt-tokens {self.max_prompt_tokens}", None))
        if not candidates:
            return FALLBACK_CONTEXT_TOKENS, (f"the model names no context; the worker's default is "
                                             f"{FALLBACK_CONTEXT_TOKENS:,}, --max-prompt-tokens sets another"), None
        return min(candidates, key=lambda candidate: candidate[0])


def request_text_chars(request: ChatRequest) -> int:
    """Characters of text in the request's messages (images are bounded apart)."""
    return sum(len(part) for message in request.messages for part in message.parts if isinstance(part, str))


def context_tokens_of(config: Any) -> int | None:
    """The context length a model config names (its text model's, for a vision-language model): a transformers
    config object or a config.json dict. None when it names none."""
    if isinstance(config, dict):
        sources: tuple = (config.get("text_config"), config)
        read = lambda source, name: source.get(name)                 # noqa: E731
    else:
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else None
        sources = (text, config)
        read = lambda source, name: getattr(source, name, None)      # noqa: E731
    for source in sources:
        if not source:
            continue
        for name in CONTEXT_ATTRIBUTES:
            value = read(source, name)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 2:
                return value
    return None
