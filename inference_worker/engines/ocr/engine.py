"""The CPU engine: read the screen's text with RapidOCR and describe it, with no GPU, no weights, no torch.

It answers in DeskEye's schema ({"summary", "key_objects"}): the summary names the kind of screen and
quotes its salient lines; key_objects come from the bilingual vocabulary in `concepts`. A question
gets the same description with the lines that mention the question's words first. It never invents
anything that is not in the text it read.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, replace
from typing import Any, Sequence

from inference_worker.engines.base import OneRowEngine, Prepared, emit_in_pieces
from inference_worker.engines.options import EngineOptions
from inference_worker.engines.ocr.reader import OcrConfig, OcrLine, OcrReader, ReadResult, to_bgr, warm_up_frame
from inference_worker.engines.ocr.screen import describe_screen, faithful_lines
from inference_worker.engines.ocr.windows import segment
from inference_worker.engines.ocr.wording import ENGLISH_WORDING, Wording, reframe, wording_for
from inference_worker.protocol import ChatRequest, Completion, CompletionFacts, OcrFacts, ProtocolError
from inference_worker.schemas import schema_problem
from inference_worker.engines.ocr.concepts import (LineLike, ScreenDescription, clean, compact, compose_summary, schema_safe,
                                                   describe, extract_entities, match_concepts, salient_order)


class OcrEngine(OneRowEngine):
    kind = "ocr"
    model_name = "deskeye-ocr"

    def __init__(self, config: OcrConfig | None = None, reader: OcrReader | None = None, *, preload: bool = True,
                 options: EngineOptions = EngineOptions()):
        """`preload`: load the models now, warm them up and describe the warm-up frame once (~1 s, what the
        worker's "loading" state is for: the first request then costs what any other does) rather than on the
        first request. `options`: the worker's engine options (only the image limits apply)."""
        self.image_limits = options.image_limits
        self.reader = reader or OcrReader(config)
        if preload:
            self.reader.load()
            self._warm_up()

    def _warm_up(self) -> None:
        """Describe the reader's warm-up read once, answer and schema check included: the describe path's lazy
        imports (the schema validator's) and first-use costs are paid while loading."""
        warm_up = self.reader.warm_up_result
        if warm_up is not None:
            described = describe_frame(warm_up, to_bgr(warm_up_frame(*warm_up.frame_size)), (), "")
            render_answer(described, WARM_UP_SCHEMA)

    def answer(self, item: Prepared) -> Completion:
        """Read the images, describe them, and stream the answer word by word to a streamed request."""
        request, images = item.request, item.images
        if not images:
            raise ProtocolError("The ocr engine reads the text in an image, and this request has none: send the "
                                "screen as an image_url part (data:image/png;base64,...) in the user message.",
                                param="messages")
        started = time.perf_counter()
        reads = [self.reader.read(image) for image in images]
        question = question_of(request)
        wording = wording_for(request.language, question)
        if len(images) == 1:
            described = describe_frame(reads[0], to_bgr(images[0]), request.windows, question, wording)
        else:
            described = describe_reads(reads, question, wording)
        text = render_answer(described, request.json_schema)
        emit_in_pieces(text, item.on_text)
        return Completion(
            text=text, finish_reason="stop",
            prompt_tokens=approx_tokens(" ".join(m.text for m in request.messages)) + sum(len(r.lines) for r in reads),
            completion_tokens=approx_tokens(text),
            facts=CompletionFacts(ocr=ocr_facts(reads, time.perf_counter() - started)),
        )

    def close(self) -> None:
        self.reader.close()


def question_of(request: ChatRequest) -> str:
    """The text of the last user message: the question asked about the image."""
    for message in reversed(request.messages):
        if message.role == "user":
            return message.text.strip()
    return ""


#: the shape of DeskEye's answer schema (deskeye/prompt.py), for the warm-up's schema check
WARM_UP_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["summary", "key_objects"],
                  "properties": {"summary": {"type": "string", "maxLength": 1200},
                                 "key_objects": {"type": "array", "maxItems": 12, "items": {"type": "string"}}}}

#: a line's text is screen content an attacker may choose; the vocabulary's patterns take time quadratic in a
#: line's length (~0.13 s for 1,500 characters), so only its start is matched (a summary quotes 200 at most)
MAX_LINE_CHARS = 400


def describe_reads(reads: list[ReadResult], question: str,
                   wording: Wording = ENGLISH_WORDING) -> ScreenDescription:
    """One description of all images: their lines stacked top to bottom, in request order."""
    lines: list[OcrLine] = []
    offset_px = 0
    for read in reads:
        lines.extend(_bounded(_shifted(line, offset_px)) for line in read.lines)
        offset_px += read.frame_size[1]
    return answer(lines, max(1, offset_px), question, wording=wording)


def describe_frame(read: ReadResult, bgr, windows, question: str,
                   wording: Wording = ENGLISH_WORDING) -> ScreenDescription:
    """One frame: its windows (from the request's window facts, else from the pixels), the foreground one
    first; a question's lines first when it has content words. Framed in `wording`'s language."""
    height = max(1, read.frame_size[1])
    views = segment(read.lines, bgr, windows)
    described = describe_screen(views, bgr, height)
    if not question_words(question):
        return reframed(described, wording)
    lines = [line for view in views for line in faithful_lines(view.lines, bgr)]
    return answer(lines, height, question, described, wording)


def reframed(described: ScreenDescription, wording: Wording) -> ScreenDescription:
    """The description with its framing (kind, leads, separators) in `wording`'s language; quotes as read."""
    return replace(described, summary=reframe(described.summary, wording))


def render_answer(described: ScreenDescription, schema: dict[str, Any] | None) -> str:
    """JSON in DeskEye's schema when the request asks for JSON; otherwise plain text."""
    if schema is None:
        objects = f" Key objects: {', '.join(described.key_objects)}." if described.key_objects else ""
        return described.summary + objects
    # every piece (quoted lines, window titles, objects) in the schema's alphabet: no double quote, no backslash
    data = {"summary": schema_safe(described.summary), "key_objects": [schema_safe(o) for o in described.key_objects]}
    problem = schema_problem(data, schema)   # the safe validator: the summary echoes the question
    if problem:
        raise ProtocolError("The ocr engine only answers in DeskEye's schema {\"summary\": string, "
                            f"\"key_objects\": [string]}}, which does not fit this request's schema ({problem}). "
                            "Use DeskEye's schema (deskeye/prompt.py), json_object, or plain text.", param="response_format")
    return json.dumps(data, ensure_ascii=False)


def ocr_facts(reads: list[ReadResult], elapsed_s: float) -> OcrFacts:
    """What the reader did, for the response's `deskeye` field and the benchmarks."""
    return OcrFacts(
        num_lines=sum(len(r.lines) for r in reads),
        num_regions_read=sum(len(r.regions) for r in reads),
        area_read_fraction=round(sum(r.area_read_fraction for r in reads) / len(reads), 4),
        full_reads=sum(r.is_full_read for r in reads),
        read_ms=round(sum(r.read_s for r in reads) * 1000, 1),
        total_ms=round(elapsed_s * 1000, 1),
    )


def approx_tokens(text: str) -> int:
    """An OCR engine has no tokenizer: about four characters per token, for usage accounting only."""
    return math.ceil(len(text) / 4)


def _bounded(line: OcrLine) -> OcrLine:
    if len(line.text) <= MAX_LINE_CHARS:
        return line
    return OcrLine(line.text[:MAX_LINE_CHARS], line.box, line.score)


def _shifted(line: OcrLine, offset_px: int) -> OcrLine:
    if not offset_px:
        return line
    left, top, right, bottom = line.box
    return OcrLine(line.text, (left, top + offset_px, right, bottom + offset_px), line.score)


# -------------------------------------------------------------------- answering a question

QUESTION_STOPWORDS = frozenset("""
a an the is are was were be been am what whats what's which who whom whose when where why how does do did done
can could would should will shall may might must i me my mine you your it its it's this that these those there
here on in at of to for from with about into onto by as and or but not no yes any some all please tell show say
says said read screen window display displayed see seen look looking line lines text word words written write
thing things many much describe description summary summarize summarise now currently right just there's whats
out off up get got has have had than then them they their there also very more most other own same too
mean means meant meaning explain explains explanation
""".split())
#: the question is request content of any length: only its start is matched against the screen's lines (each
#: word is looked for in every line, so an unbounded question would hold the model thread for minutes)
MAX_QUESTION_CHARS = 2000
MAX_QUESTION_WORDS = 16
CJK_STOP_CHARS = frozenset("的是了吗呢啊吧我你他她它这那哪什么怎么样有没在上下里中个几多少请告诉说写屏幕显示看到内容一些")
#: how a question asks, not what it asks about ("这个错误是什么意思" is about 错误, not 意思): dropped before the
#: split at stop characters, longest first (什么意思 before 意思); a fixed list, matched with str.replace
CJK_QUESTION_PHRASES = tuple(sorted((
    "什么意思", "什麼意思", "意思", "含义", "含義", "意味着", "意味著", "为什么", "為什麼", "怎么办", "怎麼辦", "怎么", "怎麼",
    "如何", "哪里", "哪裡", "这个", "這個", "那个", "那個", "请问", "請問", "告诉我", "告訴我", "解释", "解釋", "说明", "說明",
    "一下"), key=len, reverse=True))


@dataclass(frozen=True)
class QuestionWord:
    shown: str                  # as the summary names it
    keys: tuple[str, ...]       # a line mentions the word when its compacted text contains one of these


def question_words(question: str) -> list[QuestionWord]:
    """The question's content words: Latin words of 3+ letters that are not stop words (a plural 's'
    dropped), and CJK phrases (question phrases dropped, split at function characters; matched by their
    two-character pieces). Empty = "describe the screen"."""
    text = clean(question[:MAX_QUESTION_CHARS]).lower()
    for phrase in CJK_QUESTION_PHRASES:
        text = text.replace(phrase, " ")
    words = []
    for word in re.findall(r"[a-z0-9][a-z0-9'-]*", text):
        if len(word) >= 3 and word not in QUESTION_STOPWORDS:
            stem = word[:-1] if len(word) > 4 and word.endswith("s") and not word.endswith("ss") else word
            words.append(QuestionWord(word, (stem,)))
    for run in re.findall(r"[\u3400-\u9fff]+", text):
        for phrase in re.split("[" + "".join(sorted(CJK_STOP_CHARS)) + "]+", run):
            if len(phrase) >= 2:
                words.append(QuestionWord(phrase, tuple(phrase[i:i + 2] for i in range(len(phrase) - 1))))
    return list({w.shown: w for w in words}.values())[:MAX_QUESTION_WORDS]


def answer(lines: Sequence[LineLike], frame_height: int, question: str,
           described: ScreenDescription | None = None, wording: Wording = ENGLISH_WORDING) -> ScreenDescription:
    """The description (`described`, else one made of `lines`), with the lines that contain the question's words
    quoted first. A question with no content words ("what is on my screen?") gets the plain description; one no
    line mentions says so. Framed in `wording`'s language."""
    described = described or describe(lines, frame_height)
    words = question_words(question)
    texts = [clean(line.text) for line in lines]
    if not words or not any(texts):
        return reframed(described, wording)
    ranked = salient_order(lines, texts, match_concepts(texts), extract_entities(texts), frame_height)
    keys = [key for word in words for key in word.keys]
    relevant = [i for i in ranked if any(key in compact(texts[i]) for key in keys)]
    asked = wording.asked([w.shown for w in words[:3]])
    if relevant:
        rest = [i for i in ranked if i not in relevant]
        sections = [(wording.about.format(asked=asked), [texts[i] for i in relevant]),
                    (wording.also_on_screen, [texts[i] for i in rest])]
        summary, (first, second) = compose_summary(sections)
        quoted = [relevant[i] for i in first] + [rest[i] for i in second]
    else:
        lead = wording.nothing_mentions.format(asked=asked, kind=wording.kind(described.kind))
        summary, (first,) = compose_summary([(lead, [texts[i] for i in ranked])])
        quoted = [ranked[i] for i in first]
    return ScreenDescription(reframe(summary, wording), described.key_objects, described.kind, described.matches,
                             described.entities, quoted)
