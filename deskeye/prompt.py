"""The app's own words to the model: system prompt, describe question (both in the user's language), the answer
schema it asks for, and the two data types that carry a conversation (`Turn`) and an answer (`Description`).

Messages are OpenAI chat completions (any OpenAI-compatible server can answer them). The schema is the app's: a
worker serves whatever schema a request carries. The worker knows only the bounds its OCR engine writes within
(`inference_worker/protocol.py`); tests/test_prompt.py checks the two agree, so the app never imports the worker
package. Pure Python: no I/O, nothing at import.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

from deskeye.language import ENGLISH, answer_language

SUMMARY_MAX_CHARS = 200
OBJECT_MAX_CHARS = 40
MAX_KEY_OBJECTS = 8

# What the app sends at most. A model reads a bounded prompt (its context: a worker refuses a longer one with a 400),
# and every token of it is prefill the model thread spends before answering, so a pasted log or a long conversation
# is cut here, where the user can be told, rather than refused there. About 4 characters make a token: the question
# takes at most ~500 tokens and the conversation ~1,500, which leave room for a frame in an 8K context.
MAX_QUESTION_CHARS = 2000
MAX_TURN_CHARS = 600             # one remembered question or answer
MAX_MEMORY_CHARS = 6000          # all remembered turns together; the oldest are left out first
CUT_MARK = " […] "

# A string that always closes: no control characters, at most N characters. Grammar engines ignore
# maxLength when a pattern is set, so the bound lives in the pattern itself. xgrammar (vLLM's and SGLang's default
# backend) fails to compile a bounded repeat above 128 (`{0,129}`), so a longer bound is written as a run of
# shorter repeats (`{0,100}{0,100}` for 200): the same language, and every backend (xgrammar, llguidance,
# outlines-core) compiles it (tests/test_vllm_schema_backends.py). The characters exclude `"` and `\`: outlines-core
# puts the pattern inside the JSON string's quotes as is, and with a quote in the class its automaton explodes
# (no index after 5 minutes); without them the raw JSON text is the decoded text, so all backends agree exactly.
MAX_GRAMMAR_REPEAT = 128
_TEXT_CHAR = '[^\\u0000-\\u001f"\\\\]'   # printable, and no quote or backslash: see above


def bounded_text_pattern(min_chars: int, max_chars: int) -> str:
    """`^X{min,max}$` for a printable character X, with every bounded repeat at most MAX_GRAMMAR_REPEAT."""
    num_runs = -(-max_chars // MAX_GRAMMAR_REPEAT)
    runs = []
    for index in range(num_runs):
        run_max = max_chars // num_runs + (1 if index < max_chars % num_runs else 0)
        run_min = min(min_chars, run_max) if index == 0 else 0
        runs.append(f"{_TEXT_CHAR}{{{run_min},{run_max}}}")
    return "^" + "".join(runs) + "$"


DESKEYE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "summary": {"type": "string", "pattern": bounded_text_pattern(0, SUMMARY_MAX_CHARS)},
        "key_objects": {
            "type": "array",
            "items": {"type": "string", "pattern": bounded_text_pattern(1, OBJECT_MAX_CHARS)},
            "maxItems": MAX_KEY_OBJECTS,
        },
    },
    "required": ["summary", "key_objects"],
    "additionalProperties": False,
}
DESKEYE_SCHEMA_NAME = "deskeye_description"

SYSTEM_PROMPT = (
    "You are DeskEye, a private desktop assistant. You see a region of the user's screen. "
    "Answer in JSON with a short 'summary' of what is on the screen (or the answer to the question) "
    "and 'key_objects': the few things on screen that matter."
)
DESCRIBE_QUESTION = "What is on this screen?"
# The describe question in each language DeskEye speaks (deskeye/language.py), so that a model (and the OCR engine,
# which reads only the question) sees the user's language; none has a content word the OCR engine would quote back.
DESCRIBE_QUESTIONS = {"en": DESCRIBE_QUESTION, "zh_CN": "屏幕上有什么？", "zh_TW": "螢幕上有什麼？"}
# The sentence that asks for the answer's language, ending the system prompt. It names the language in English (the
# prompt's language) and in itself: small models follow that more reliably than the name alone.
ANSWER_LANGUAGE_NAMES = {"en": "English", "zh_CN": "Simplified Chinese (简体中文)",
                         "zh_TW": "Traditional Chinese (繁體中文)"}
ANSWER_LANGUAGE_SENTENCE = ("Write the summary and the key_objects in {name}, whatever language the screen is in; "
                            "keep names, numbers and code as they are on the screen.")


@dataclass(frozen=True)
class Turn:
    question: str
    answer: str


@dataclass(frozen=True)
class Description:
    summary: str
    key_objects: list[str]


def image_data_url(png: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(png).decode('ascii')}"


def cut_sizes(max_chars: int) -> tuple[int, int]:
    """How many characters of a cut text's start and end `cut_text` keeps (with CUT_MARK, `max_chars` in all)."""
    keep = max(0, max_chars - len(CUT_MARK))
    return keep - keep // 4, keep // 4


def cut_text(text: str, max_chars: int) -> str:
    """`text` if it has at most `max_chars` characters, else its start and its end (a question's ask is often its
    last line) around CUT_MARK, `max_chars` characters in all."""
    if len(text) <= max_chars:
        return text
    head, tail = cut_sizes(max_chars)
    return text[:head] + CUT_MARK + (text[len(text) - tail:] if tail else "")


def bound_question(question: str) -> tuple[str, str | None]:
    """The question as sent (at most MAX_QUESTION_CHARS) and, when it was cut, a note for the user saying so."""
    if len(question) <= MAX_QUESTION_CHARS:
        return question, None
    head, tail = cut_sizes(MAX_QUESTION_CHARS)
    return cut_text(question, MAX_QUESTION_CHARS), (
        f"Your question was {len(question):,} characters long; DeskEye sent only its first {head:,} and last "
        f"{tail:,} characters (at most {MAX_QUESTION_CHARS:,}). Ask a shorter question to send all of it.")


def bound_turn(turn: Turn) -> Turn:
    """One remembered turn, each side at most MAX_TURN_CHARS."""
    return Turn(cut_text(turn.question, MAX_TURN_CHARS), cut_text(turn.answer, MAX_TURN_CHARS))


def bound_memory(memory: list[Turn]) -> tuple[list[Turn], int]:
    """The newest turns (each bounded) that fit in MAX_MEMORY_CHARS together, oldest first, and how many older
    turns were left out."""
    kept: list[Turn] = []
    used = 0
    for turn in reversed([bound_turn(t) for t in memory]):
        size = len(turn.question) + len(turn.answer)
        if used + size > MAX_MEMORY_CHARS:
            break
        kept.append(turn)
        used += size
    kept.reverse()
    return kept, len(memory) - len(kept)


def describe_question(language: str) -> str:
    """The question a describe asks, in `language` ("en", "zh_CN", "zh_TW")."""
    return DESCRIBE_QUESTIONS[language]


def system_prompt(language: str) -> str:
    """The system prompt asking for an answer in `language`."""
    return f"{SYSTEM_PROMPT} {ANSWER_LANGUAGE_SENTENCE.format(name=ANSWER_LANGUAGE_NAMES[language])}"


def build_messages(question: str, image_png: bytes | None, memory: list[Turn] = (),
                   context: str | None = None, *, language: str = ENGLISH) -> list[dict[str, Any]]:
    """OpenAI-format messages: system prompt, previous turns, then the question with the frame, as given (the app's
    client bounds the question and the turns first: `bound_question`, `bound_memory`). The model is asked to answer
    in the user's `language`, or in Chinese for a question asked in Chinese (`answer_language`)."""
    system = system_prompt(answer_language(question, language))
    if context:
        system = f"{system}\nText read on the screen:\n{context}"
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for turn in memory:
        messages.append({"role": "user", "content": turn.question})
        messages.append({"role": "assistant", "content": turn.answer})
    content: list[dict[str, Any]] = []
    if image_png is not None:
        content.append({"type": "image_url", "image_url": {"url": image_data_url(image_png)}})
    content.append({"type": "text", "text": question})
    messages.append({"role": "user", "content": content})
    return messages


def deskeye_response_format() -> dict[str, Any]:
    return {"type": "json_schema",
            "json_schema": {"name": DESKEYE_SCHEMA_NAME, "schema": DESKEYE_SCHEMA, "strict": True}}


def parse_description(content: str) -> Description:
    """Read an answer in DeskEye's schema. Raises ValueError naming what was wrong."""
    try:
        data = json.loads(content)
    except json.JSONDecodeError as exc:
        raise ValueError(f"The model's answer is not JSON ({exc.msg} at char {exc.pos}).") from None
    if not isinstance(data, dict) or not isinstance(data.get("summary"), str):
        raise ValueError("The model's answer has no 'summary' string.")
    objects = data.get("key_objects", [])
    if not isinstance(objects, list) or not all(isinstance(o, str) for o in objects):
        raise ValueError("The model's answer has 'key_objects' that is not a list of strings.")
    return Description(data["summary"], objects)
