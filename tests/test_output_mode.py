"""The client's ladder for answers it cannot use (deskeye/worker/output_mode.py): pure functions on the answer text.

The ladder against real servers: tests/test_external_server.py (transformers serve ignores response_format) and
tests/test_vllm_e2e.py (vLLM cuts an answer off at a small max_tokens)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from deskeye.worker import output_mode
from deskeye.worker.output_mode import JSON_SCHEMA, PROMPT_AND_PARSE, Attempt, judge, lenient_description
from inference_worker.protocol import MAX_KEY_OBJECTS, SUMMARY_MAX_CHARS
from deskeye.prompt import DESKEYE_SCHEMA, Description

GOOD = '{"summary": "A terminal", "key_objects": ["terminal"]}'


def test_a_schema_answer_is_read_as_is():
    outcome = judge(Attempt(JSON_SCHEMA, 256), GOOD, "stop", 256)
    assert outcome.description == Description("A terminal", ["terminal"]) and outcome.next_attempt is None


def test_a_cut_off_answer_gets_twice_the_room_up_to_the_cap():
    attempt, seen = Attempt(JSON_SCHEMA, 256), []
    while (outcome := judge(attempt, '{"summary": "A termi', "length", 256)).next_attempt is not None:
        attempt = outcome.next_attempt
        seen.append(attempt.max_tokens)
    assert seen == [512, 1024] and attempt.mode == JSON_SCHEMA        # bounded: 2 retries, 4x the setting
    assert outcome.description is None and not outcome.ignored_schema


def test_the_cap_never_exceeds_max_room_tokens():
    assert output_mode.room_cap(2000) == output_mode.MAX_ROOM_TOKENS
    outcome = judge(Attempt(JSON_SCHEMA, 4096), '{"summary": "x', "length", 4096)
    assert outcome.next_attempt is None                                  # already at the cap


def test_broken_json_that_was_not_cut_off_is_not_retried():
    assert judge(Attempt(JSON_SCHEMA, 256), '{"summary": 3}', "stop", 256).next_attempt is None


def test_free_text_in_schema_mode_means_the_server_ignored_response_format():
    outcome = judge(Attempt(JSON_SCHEMA, 256), "The screen shows a terminal.", "stop", 256)
    assert outcome.ignored_schema and outcome.next_attempt == Attempt(PROMPT_AND_PARSE, 256)


def test_prompt_mode_asks_for_json_in_the_system_prompt_without_response_format():
    messages = [{"role": "system", "content": "You are DeskEye."}, {"role": "user", "content": "hi"}]
    fields = output_mode.request_fields(Attempt(PROMPT_AND_PARSE, 64), messages)
    assert "response_format" not in fields and fields["max_tokens"] == 64
    assert fields["messages"][0]["content"].startswith("You are DeskEye.\n") and fields["messages"][1:] == messages[1:]
    assert output_mode.JSON_INSTRUCTION in fields["messages"][0]["content"]
    strict = output_mode.request_fields(Attempt(PROMPT_AND_PARSE, 64, is_strict=True), messages)
    assert output_mode.STRICT_JSON_INSTRUCTION in strict["messages"][0]["content"]
    assert messages[0]["content"] == "You are DeskEye."                              # the caller's list is untouched
    schema = output_mode.request_fields(Attempt(JSON_SCHEMA, 64), messages)
    assert schema["response_format"]["json_schema"]["schema"] == DESKEYE_SCHEMA and schema["messages"] == messages


@pytest.mark.parametrize("text", [
    "Sure! Here it is:\n```json\n" + GOOD + "\n```",
    "{not json} then " + GOOD + " and more {",
    GOOD,
])
def test_lenient_parsing_finds_the_object_among_words_and_fences(text):
    assert lenient_description(text) == Description("A terminal", ["terminal"])


def test_lenient_parsing_cuts_to_deskeye_bounds_and_drops_non_strings():
    data = {"summary": "x" * 500 + "\u0007", "key_objects": ["a\nb", 3, "", *[f"o{i}" for i in range(20)]],
            "extra": 1}
    description = lenient_description(json.dumps(data))
    assert len(description.summary) == SUMMARY_MAX_CHARS and description.key_objects[0] == "a b"
    assert len(description.key_objects) == MAX_KEY_OBJECTS
    jsonschema.validate({"summary": description.summary, "key_objects": description.key_objects}, DESKEYE_SCHEMA)


def test_prompt_mode_retries_strictly_then_takes_the_text_as_the_summary():
    first = judge(Attempt(PROMPT_AND_PARSE, 64), "A terminal with\x1b[31m a log", "stop", 64)
    assert first.next_attempt == Attempt(PROMPT_AND_PARSE, 64, is_strict=True) and first.description is None
    last = judge(first.next_attempt, "A terminal with\x1b[31m a log", "stop", 64)
    assert last.is_plain_text and last.description == Description("A terminal with [31m a log", [])
    assert judge(first.next_attempt, "  \n", "stop", 64).description is None      # nothing to show: give up


def test_prompt_mode_gives_a_cut_off_json_more_room_first():
    outcome = judge(Attempt(PROMPT_AND_PARSE, 64), 'Here: {"summary": "A ter', "length", 64)
    assert outcome.next_attempt == Attempt(PROMPT_AND_PARSE, 128, num_room_retries=1)


def test_an_attempt_names_a_bad_mode():
    with pytest.raises(ValueError, match="output mode 'xml'"):
        Attempt("xml", 10)
