"""Whole-term matching for hook keywords: a term is found where it starts and ends at word boundaries of the text.

What a word boundary is:
- text and term are compared as `normalise` makes them (NFKC, casefolded, one space), so "ERROR", "Error" and
  the full-width "ＥＲＲＯＲ" are one word;
- between two letters or digits of a script written with spaces (Latin, Greek, Cyrillic, Hangul, kana, ...) there
  is none: "error" is not found in "terrors" or "errorlog", "new mail" not in "new mailbox"; white space,
  punctuation and a change of script (Latin to Chinese) are boundaries;
- Chinese is written without spaces, so between two Han characters the boundary is where a dictionary word
  segmenter puts one (jieba's dictionary through `rjieba`, dictionary words only, no guessing of unknown ones).
  A Chinese term is found only as whole words: 失败 in 保存失败 (保存|失败) and 错误 in 发生错误, but 会议 not in
  会议室 (a meeting room), 错误 not in 错误码 (an error code), 邮件 not in 垃圾邮件 (spam) nor in 新邮件 (new mail:
  list 新邮件 itself). Han characters the dictionary does not know stand as words of one character, so where it
  knows few words (most traditional characters) a term is found wherever its characters occur.

Model text is untrusted: no regular expression runs here. Occurrences are found with `str.find`, boundaries are
decided by character class, and the segmenter (a dictionary DAG and one dynamic-programming pass: time linear in
the text times the longest dictionary word) runs only when an occurrence has Han characters on both sides of one
of its ends, on the Han runs of at most MAX_TEXT_CHARS characters. The segmenter's dictionary (~30 MB, ~0.5 s) is
loaded the first time it is needed, never at import.
"""

from __future__ import annotations

import threading
import unicodedata

#: how much of one text is searched: a key object has at most 40 characters and a summary 200 (deskeye.prompt);
#: `deskeye hooks fire` takes any text, and a term found only past this point is not found
MAX_TEXT_CHARS = 4000
_HAN_RANGES = ((0x3007, 0x3007), (0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF), (0x20000, 0x3134F))
_segmenter_lock = threading.Lock()
_segmenter = None


def normalise(text: str) -> str:
    """How texts and terms are compared: NFKC, casefolded, white space runs made one space, no space at the ends,
    the typographic apostrophe as the plain one (couldn’t = couldn't)."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().replace("\u2019", "'").split())


def is_han(char: str) -> bool:
    code = ord(char)
    return any(low <= code <= high for low, high in _HAN_RANGES)


def _is_word_char(char: str) -> bool:
    return char.isalnum() or char == "_" or unicodedata.category(char).startswith("M")


class TermText:
    """One text to look for terms in; its Chinese word boundaries are worked out once, when first needed."""

    def __init__(self, text: str):
        self.text = normalise(text)[:MAX_TEXT_CHARS]
        self._han_cuts: frozenset[int] | None = None

    def first_of(self, terms: tuple[str, ...]) -> str | None:
        """The first of `terms` (each already `normalise`d) found as a whole term, or None."""
        return next((term for term in terms if self.has(term)), None)

    def has(self, term: str) -> bool:
        start = self.text.find(term)
        while start >= 0:
            if self._is_boundary(start) and self._is_boundary(start + len(term)):
                return True
            start = self.text.find(term, start + 1)
        return False

    def _is_boundary(self, position: int) -> bool:
        if position <= 0 or position >= len(self.text):
            return True
        before, after = self.text[position - 1], self.text[position]
        if is_han(before) and is_han(after):
            return position in self._cuts()
        return is_han(before) or is_han(after) or not (_is_word_char(before) and _is_word_char(after))

    def _cuts(self) -> frozenset[int]:
        """The positions inside the text's Han runs where the segmenter puts a word boundary."""
        if self._han_cuts is None:
            cuts, start = set(), None
            for position, char in enumerate(self.text + " "):
                if is_han(char):
                    start = position if start is None else start
                elif start is not None:
                    for word in _segment(self.text[start:position]):
                        start += len(word)
                        cuts.add(start)
                    start = None
            self._han_cuts = frozenset(cuts)
        return self._han_cuts


def _segment(han_run: str) -> list[str]:
    """The dictionary words of a run of Han characters, in order (they add up to the run)."""
    global _segmenter
    with _segmenter_lock:
        if _segmenter is None:
            import rjieba                # loads jieba's dictionary: once, and only for Chinese text
            _segmenter = rjieba
    words = _segmenter.cut(han_run, hmm=False)   # dictionary words only, no HMM guesses for unknown ones
    return words if "".join(words) == han_run else list(han_run)   # (else: one-character words, as unknown ones)
