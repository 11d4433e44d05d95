"""A streamed row's text as it is generated: token ids in, new text out, for `Prepared.on_text`.

Each new token re-decodes the row's tokens so far (the tokenizer's own merging of byte-level pieces and
spaces stays right) and hands on what was added. Text that ends in a partial UTF-8 character (U+FFFD) waits for
the next token; end-of-sequence tokens add nothing. The pieces concatenate to the final decoded answer.
"""

from __future__ import annotations

from typing import Any, Callable, Collection


class TextStream:
    def __init__(self, tokenizer: Any, eos_token_ids: Collection[int], on_text: Callable[[str], None]):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.on_text = on_text
        self.token_ids: list[int] = []
        self.sent = ""

    def __call__(self, token_id: int) -> None:
        if token_id in self.eos_token_ids:
            return
        self.token_ids.append(int(token_id))
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if text.endswith("\ufffd") or not text.startswith(self.sent):
            return                     # a partial character, or a re-merge: wait for the next token
        delta, self.sent = text[len(self.sent):], text
        if delta:
            self.on_text(delta)


def text_stream(tokenizer: Any, eos_token_ids: Collection[int],
                on_text: Callable[[str], None] | None) -> TextStream | None:
    return None if on_text is None else TextStream(tokenizer, eos_token_ids, on_text)
