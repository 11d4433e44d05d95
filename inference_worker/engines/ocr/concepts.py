"""What the text on a screen says about it: the concepts of the vocabulary (`vocabulary`) its lines mention,
entity extraction (times, dates, links, amounts, unread counts) and the summary the OCR engine answers with.

The vocabulary is data, kept in `vocabulary.py`. Everything here is a pure function of the recognised lines;
OCR text is untrusted and only ever quoted, never interpreted.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from typing import Protocol, Sequence

from inference_worker.engines.ocr.vocabulary import ENTITY_KINDS, VOCABULARY, Concept
from inference_worker.protocol import MAX_KEY_OBJECTS, OBJECT_MAX_CHARS, SUMMARY_MAX_CHARS


_COMPILED_PATTERNS = {p: re.compile(p) for c in VOCABULARY for p in c.patterns}
_COMPILED_ENTITIES = [(kind, [re.compile(p) for p in kind.patterns]) for kind in ENTITY_KINDS]
_CONTROL = re.compile(r"[\u0000-\u001f\u007f-\u009f]+")
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u9fff\uf900-\ufaff]")


class LineLike(Protocol):
    text: str
    box: tuple[int, int, int, int]    # left, top, right, bottom


@dataclass(frozen=True)
class ConceptMatch:
    concept: Concept
    score: float
    evidence: tuple[tuple[int, int], ...]    # (rank of the term/pattern that matched, line index)

    def matched_terms(self) -> list[str]:
        """The terms and patterns that matched, most telling first (patterns rank before terms)."""
        vocabulary = self.concept.patterns + self.concept.terms
        return [vocabulary[rank] for rank in sorted({rank for rank, _ in self.evidence})]

    @property
    def strength(self) -> int:
        """Pieces of evidence: distinct (term, line) pairs, at most 4."""
        return min(len(set(self.evidence)), 4)

    @property
    def is_sure(self) -> bool:
        """A strong concept, or two pieces of evidence: one weak word ('report') is not enough."""
        return self.concept.is_strong or self.strength >= 2

    @property
    def names_screen(self) -> bool:
        return self.concept.screen is not None and self.is_sure


@dataclass(frozen=True)
class Entity:
    kind: str
    value: str
    line_index: int

    @property
    def key_object(self) -> str:
        label = next(k.label for k in ENTITY_KINDS if k.name == self.kind)
        return bounded(label.format(self.value), OBJECT_MAX_CHARS)


@dataclass(frozen=True)
class ScreenDescription:
    summary: str
    key_objects: list[str]
    kind: str                        # how the screen was named ("An email inbox"; "Text on screen" when unsure)
    matches: list[ConceptMatch]
    entities: list[Entity]
    quoted: list[int]                # indexes of the lines the summary quotes, in quoting order


# -------------------------------------------------------------------- text normalisation

def clean(text: str) -> str:
    """OCR text made safe to quote: NFKC (full-width forms to ASCII), no control characters, single spaces."""
    return " ".join(_CONTROL.sub(" ", unicodedata.normalize("NFKC", text)).split())


def schema_safe(text: str) -> str:
    """Text for DeskEye's answer schema, which admits no double quote or backslash (deskeye/prompt.py says why):
    a double quote as a single one, a backslash as a slash. Matching keeps seeing the text as read."""
    return text.replace('"', "'").replace("\\", "/")


def compact(text: str) -> str:
    """Lower case without spaces: OCR often drops or adds spaces on small screen text."""
    return "".join(clean(text).lower().split())


def bounded(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else text[:max_chars - 1].rstrip() + "…"


@dataclass(frozen=True)
class Term:
    """A vocabulary term, prepared once: CJK terms and long Latin terms match anywhere in a line's compacted
    text (OCR drops and adds spaces); short Latin terms only as whole words ('mute' is not in 'minute')."""
    term: str
    compacted: str
    regex: re.Pattern | None      # None: substring match only (CJK)

    @classmethod
    def of(cls, term: str) -> "Term":
        words = [re.escape(w) for w in term.lower().split()]
        regex = None if _CJK.search(term) else re.compile(r"(?<![a-z])" + r"\s*".join(words) + r"(?![a-z])")
        return cls(term, compact(term), regex)

    @property
    def is_loose(self) -> bool:
        return self.regex is None or len(self.compacted) >= 6

    def found_in(self, line: "PreparedLine") -> bool:
        if self.is_loose and self.compacted in line.compact_words:
            return True
        return self.regex is not None and self.regex.search(line.lower_words) is not None


@dataclass(frozen=True)
class PreparedLine:
    """A line cleaned once for matching. Terms are looked for outside links and paths; patterns see the
    whole line."""
    text: str
    lower_words: str
    compact_words: str

    @classmethod
    def of(cls, text: str) -> "PreparedLine":
        cleaned = clean(text)
        words = _LINK.sub(" ", cleaned).lower()
        return cls(cleaned, words, "".join(words.split()))


_LINK = re.compile(r"(?i)\b(?:https?://|www\.)\S+|\b[\w.-]+\.(?:com|org|net|io|dev|cn|co|ai|app)(?:/\S*)?"
                   r"|\S*[/\\]\S*")   # links and paths: 'login' in a URL is no sign-in form
_TERMS = {t: Term.of(t) for c in VOCABULARY for t in c.terms}


def term_in(term: str, text: str) -> bool:
    """Whether a vocabulary term occurs in a line (see Term)."""
    return (_TERMS.get(term) or Term.of(term)).found_in(PreparedLine.of(text))


# -------------------------------------------------------------------- concepts and entities

def match_concepts(texts: Sequence[str]) -> list[ConceptMatch]:
    """Concepts the lines mention, best first. Score = weight x pieces of evidence (see ConceptMatch.strength)."""
    prepared = [PreparedLine.of(text) for text in texts]
    everything = PreparedLine("\n".join(p.text for p in prepared), "\n".join(p.lower_words for p in prepared),
                              "\n".join(p.compact_words for p in prepared))
    present = {term for term, prepared_term in _TERMS.items() if prepared_term.found_in(everything)}
    found: dict[str, ConceptMatch] = {}
    for concept in VOCABULARY:
        evidence = _evidence(concept, prepared, present)
        if evidence:
            found[concept.label] = ConceptMatch(concept, concept.weight * min(len(set(evidence)), 4),
                                                tuple(evidence))
    kept = [m for m in found.values() if not m.concept.needs or any(n in found for n in m.concept.needs)]
    hidden = {label for m in kept for label in m.concept.hides}
    return sorted([m for m in kept if m.concept.label not in hidden], key=lambda m: -m.score)  # ties: table order


def _evidence(concept: Concept, lines: Sequence[PreparedLine], present: set[str]) -> list[tuple[int, int]]:
    """(rank, line index) of each pattern and term found; terms are looked for only in lines when `present`
    (found in all the lines joined: a cheap first pass, since most terms are on no line)."""
    evidence = []
    terms = [(rank, term) for rank, term in enumerate(concept.terms, start=len(concept.patterns)) if term in present]
    for index, line in enumerate(lines):
        for rank, pattern in enumerate(concept.patterns):
            if _COMPILED_PATTERNS[pattern].search(line.text):
                evidence.append((rank, index))
        for rank, term in terms:
            if _TERMS[term].found_in(line):
                evidence.append((rank, index))
    return evidence


def extract_entities(texts: Sequence[str]) -> list[Entity]:
    """Times, dates, amounts, links and unread counts, in ENTITY_KINDS order, then reading order; no repeats."""
    entities: list[Entity] = []
    seen: set[tuple[str, str]] = set()
    for kind, regexes in _COMPILED_ENTITIES:
        for index, text in enumerate(texts):
            cleaned = clean(text)
            for regex in regexes:
                for found in regex.finditer(cleaned):
                    value = (found.groupdict().get("v") or found.group(0)).strip().rstrip(".,;:)")
                    if found.groupdict().get("n"):
                        value = f"{value}:{found.group('n')}"
                    if value and (kind.name, value.lower()) not in seen:
                        seen.add((kind.name, value.lower()))
                        entities.append(Entity(kind.name, value, index))
    return entities


# -------------------------------------------------------------------- the description

def describe(lines: Sequence[LineLike], frame_height: int) -> ScreenDescription:
    """Name the kind of screen, quote its salient lines (a title-like line first), list its key objects."""
    texts = [clean(line.text) for line in lines]
    if not any(texts):
        return ScreenDescription("No readable text on this screen.", [], "A screen without text", [], [], [])
    matches = [m for m in match_concepts(texts) if m.concept.layout is None]   # no layout read here
    entities = extract_entities(texts)
    kind = next((m.concept.screen for m in matches if m.names_screen), None) or "Text on screen"
    order = salient_order(lines, texts, matches, entities, frame_height)
    summary, (quoted,) = compose_summary([(f"{kind}: ", [texts[i] for i in order])])
    return ScreenDescription(summary, key_objects(matches, entities), kind, matches, entities,
                             [order[i] for i in quoted])


def key_objects(matches: Sequence[ConceptMatch], entities: Sequence[Entity]) -> list[str]:
    """Labels of the concepts we are sure of (best first, at most 4; the best one even when unsure), then
    entities taking turns by kind (the first of each kind in ENTITY_KINDS order — unread counts first —,
    then the second, ...), bounded and unique."""
    concepts = [m for i, m in enumerate(matches) if i == 0 or m.is_sure][:4]
    by_kind = [[e for e in entities if e.kind == kind.name] for kind in ENTITY_KINDS]
    turns = [group[i] for i in range(max(map(len, by_kind), default=0)) for group in by_kind if i < len(group)]
    objects: list[str] = []
    for item in [m.concept.label for m in concepts] + [e.key_object for e in turns]:
        item = bounded(schema_safe(clean(item)), OBJECT_MAX_CHARS)
        if item and item not in objects:
            objects.append(item)
    return objects[:MAX_KEY_OBJECTS]


def title_index(lines: Sequence[LineLike], texts: Sequence[str], frame_height: int) -> int | None:
    """The title-like line: the tallest box, with lines near the top preferred."""
    candidates = [i for i, t in enumerate(texts) if len(re.findall(r"\w", t)) >= 2]
    if not candidates:
        return None
    max_height = max(_height(lines[i]) for i in candidates) or 1

    def score(i: int) -> float:
        return _height(lines[i]) / max_height + 0.25 * (1 - lines[i].box[1] / max(1, frame_height))
    return max(candidates, key=lambda i: (round(score(i), 3), -i))


def salient_order(lines: Sequence[LineLike], texts: Sequence[str], matches: Sequence[ConceptMatch],
                  entities: Sequence[Entity], frame_height: int, *, title_first: bool = True) -> list[int]:
    """Line indexes, most worth quoting first: the title (unless the caller knows it: `title_first`), lines that
    made the best concepts match (their most telling term first), lines holding entities, then the rest in
    reading order. No duplicate texts."""
    rank: dict[int, tuple] = {}
    for concept_rank, match in enumerate(matches):
        for term_rank, index in match.evidence:
            rank[index] = min(rank.get(index, (9e9,)), (concept_rank, term_rank, index))
    for entity in entities:
        rank.setdefault(entity.line_index, (len(matches), 0, entity.line_index))
    title = title_index(lines, texts, frame_height) if title_first else None
    order = sorted(range(len(texts)), key=lambda i: (i != title, rank.get(i, (9e9, 0, i))))
    unique, seen = [], set()
    for i in order:
        if texts[i] and compact(texts[i]) not in seen:
            seen.add(compact(texts[i]))
            unique.append(i)
    return unique


def compose_summary(sections: Sequence[tuple[str, Sequence[str]]], max_chars: int = SUMMARY_MAX_CHARS,
                    max_quote_chars: int = 90) -> tuple[str, list[list[int]]]:
    """Each section's heading, then its texts as “quotes”; “separated”, in order, skipping texts that no
    longer fit in `max_chars`. A section none of whose texts fit is left out (heading too), except the first.
    Returns the summary and, per section, the indexes of the texts it quotes."""
    summary, quoted_per_section = "", []
    for number, (heading, texts) in enumerate(sections):
        part, quoted = heading, []
        for index, text in enumerate(texts):
            piece = ("; " if quoted else "") + f"“{bounded(schema_safe(text), max_quote_chars)}”"
            if len(summary) + len(part) + len(piece) <= max_chars:
                part += piece
                quoted.append(index)
        if quoted or number == 0:
            summary += part if quoted else part.rstrip(": ")
        quoted_per_section.append(quoted)
    return bounded(summary, max_chars), quoted_per_section


def _height(line: LineLike) -> int:
    return line.box[3] - line.box[1]
