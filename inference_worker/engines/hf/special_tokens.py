"""Keep request text from being read as the model's special tokens.

A message may spell a special token: a user asking about `<image>` tags, screen text read by OCR, a
remembered answer. Rendered into the prompt as is, `<image>` makes the processor count one image too many
(a ValueError, or image features written at the wrong place) and `<|im_start|>` / `<end_of_utterance>` forge
turns. Every text part of a request is therefore escaped before templating.

Why escape strings rather than tokenise with `split_special_tokens=True`: the processors find their markers
in the *string*, before any tokenisation (Idefics3 and LLaVA count and expand `<image>`, MiniCPM-o looks for
`<image>./</image>`), and they tokenise the whole rendered prompt in one call, in which the template's own
markers must stay special. transformers 5.24's processors also drop that keyword ("not a valid argument for
this processor and will be ignored"), so there is no per-segment tokenisation to hook into.

The escape: a character that no marker contains (U+200B ZERO WIDTH SPACE, which leaves the text reading
the same; a plain space where the tokenizer cannot encode it) goes after the first character of every
marker in the text, and at a part's edges when they could join the surrounding template text (or a
neighbouring part: some templates join parts with nothing between them) into a marker. An inserted
character cannot be part of a marker, so escaping removes every occurrence and creates none. The choice is
checked against the tokenizer when the engine is built: no escaped marker may encode to a special id.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

#: tried in order; the first that the tokenizer encodes without special ids (unk included) is used
ESCAPE_CHARS = ("\u200b", " ")
#: added tokens shaped like markup (`<think>`, `[IMG]`) are escaped even when not flagged special
_MARKUP = re.compile(r"^[<\[]\S+[>\]]$")
#: processor attributes that hold the string markers it searches the prompt for
_PROCESSOR_MARKER_SUFFIXES = ("_token", "_tag")


class SpecialTokenEscaper:
    """`escaper(text)` -> `text` with no special-token string left in it, nor at its edges."""

    def __init__(self, markers: Iterable[str], escape_char: str = ESCAPE_CHARS[0]):
        # a one-character marker cannot be broken by insertion; no tokenizer DeskEye serves has one
        self.markers = tuple(sorted({m for m in markers if len(m) >= 2}, key=lambda m: (-len(m), m)))
        if any(escape_char in m for m in self.markers):
            raise ValueError(f"The escape character {escape_char!r} occurs in a special token; it cannot escape it.")
        self.escape_char = escape_char
        self._pattern = re.compile("|".join(map(re.escape, self.markers))) if self.markers else None
        self._heads = {m[:i] for m in self.markers for i in range(1, len(m))}   # proper prefixes
        self._tails = {m[i:] for m in self.markers for i in range(1, len(m))}   # proper suffixes
        self._max_len = max(map(len, self.markers), default=0)

    def __call__(self, text: str) -> str:
        if self._pattern is None:
            return text
        previous = None
        while previous != text:          # each pass breaks occurrences and creates none, so this ends
            previous, text = text, self._pattern.sub(self._break, text)
        if self._ends_with_head(text):
            text += self.escape_char
        if self._starts_with_tail(text):
            text = self.escape_char + text
        return text

    def _break(self, match: re.Match) -> str:
        return match[0][0] + self.escape_char + match[0][1:]

    def _ends_with_head(self, text: str) -> bool:
        return any(text[-n:] in self._heads for n in range(1, min(len(text), self._max_len - 1) + 1))

    def _starts_with_tail(self, text: str) -> bool:
        return any(text[:n] in self._tails for n in range(1, min(len(text), self._max_len - 1) + 1))


def special_token_strings(tokenizer: Any, processor: Any = None) -> set[str]:
    """Every string the tokenizer reads as one special token, and the markers the processor looks for."""
    found = set(getattr(tokenizer, "all_special_tokens", ()))
    for token in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if token.special or _MARKUP.match(token.content):
            found.add(token.content)
    for name, value in vars(processor).items() if processor is not None else ():
        if isinstance(value, str) and value and name.endswith(_PROCESSOR_MARKER_SUFFIXES):
            found.add(value)
    return found


def escaper_for(tokenizer: Any, processor: Any = None) -> SpecialTokenEscaper:
    """The escaper for this tokenizer and processor, with the first escape character the tokenizer honours.

    Raises ValueError when no candidate works (a tokenizer whose normaliser drops both).
    """
    markers = special_token_strings(tokenizer, processor)
    guarded = _special_ids(tokenizer, markers)
    for escape_char in ESCAPE_CHARS:
        if any(escape_char in m for m in markers):
            continue
        escaper = SpecialTokenEscaper(markers, escape_char)
        if not escaper.markers or _encodes_without(tokenizer, [escaper(m) for m in escaper.markers], guarded):
            return escaper
    raise ValueError("This model's tokenizer still reads escaped special tokens as special ones (tried "
                     f"{', '.join(map(ascii, ESCAPE_CHARS))}), so request text cannot be kept from forging them; "
                     "use another model or tokenizer.")


def _special_ids(tokenizer: Any, markers: set[str]) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", ()))
    ids.update(tokenizer.convert_tokens_to_ids(m) for m in markers)
    return {i for i in ids if isinstance(i, int)}


def _encodes_without(tokenizer: Any, texts: list[str], ids: set[int]) -> bool:
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return not any(ids.intersection(row) for row in encoded)
