"""DeskEye's response schema on the structured-output backends vLLM and SGLang ship: xgrammar (vLLM's default,
with the grammar cache vLLM always enables), llguidance and outlines-core, each compiled through vLLM's own
backend class in .venv-vllm/ (tests/fixtures/vllm_grammar_probe.py) with the tiny model's tokenizer.

Each must compile the schema and agree on the same bounds: a 200-character summary and 8 objects of 40
characters are accepted; 201 characters, a 9th object, a 41-character object, a control character (even
escaped) and a quote are refused. The old schema's summary `{0,200}` made vLLM answer HTTP 500 with xgrammar;
tests/test_vllm_e2e.py shows describe succeeding on the default backend.
"""

from __future__ import annotations

import json
import subprocess

import jsonschema
import pytest

from deskeye.prompt import DESKEYE_SCHEMA, MAX_GRAMMAR_REPEAT
from tests.fixtures.vllm_server import vllm_env, vllm_python

pytestmark = [pytest.mark.model, pytest.mark.subprocess]

PROBE = "tests/fixtures/vllm_grammar_probe.py"


def compact(summary: str, key_objects: list[str]) -> str:
    return json.dumps({"summary": summary, "key_objects": key_objects}, ensure_ascii=False, separators=(",", ":"))


ACCEPTED = {
    "longest": compact("屏幕 terminal, 10:45 " + "x" * 181, ["o" * 40] * 8),
    "empty": compact("", []),
}
REFUSED = {
    "summary_201": compact("y" * 201, []),
    "nine_objects": compact("a", ["o"] * 9),
    "object_41": compact("a", ["o" * 41]),
    "empty_object": compact("a", [""]),
    "escaped_newline": compact("a\nb", []),
    "quote": compact('say "hi"', []),
    "extra_key": '{"summary":"a","key_objects":[],"x":1}',
}


@pytest.fixture(scope="module")
def verdicts(tiny_idefics3_vllm_dir) -> dict:
    texts = [*ACCEPTED.values(), *REFUSED.values()]
    proc = subprocess.run([str(vllm_python()), PROBE, str(tiny_idefics3_vllm_dir)],
                          input=json.dumps({"schema": DESKEYE_SCHEMA, "texts": texts}), capture_output=True,
                          text=True, timeout=600, env=vllm_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_bounded_repeat_is_at_most_128():
    patterns = [DESKEYE_SCHEMA["properties"]["summary"]["pattern"],
                DESKEYE_SCHEMA["properties"]["key_objects"]["items"]["pattern"]]
    repeats = [int(n) for pattern in patterns for n in pattern.replace("}", ",").split(",") if n.isdigit()]
    assert repeats and max(repeats) <= MAX_GRAMMAR_REPEAT


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["xgrammar", "guidance", "outlines"])
def test_the_schema_compiles_and_holds_on(backend, verdicts):
    result = verdicts[backend]
    assert result["compiled"], result["error"]
    accepted = dict(zip([*ACCEPTED, *REFUSED], result["accepted"]))
    assert [name for name in ACCEPTED if not accepted[name]] == []
    assert [name for name in REFUSED if accepted[name]] == []


@pytest.mark.slow                # 1 s or more with the fixtures it sets up
def test_the_backends_agree_on_every_text(verdicts):
    assert verdicts["xgrammar"]["accepted"] == verdicts["guidance"]["accepted"] == verdicts["outlines"]["accepted"]


def test_the_ocr_engine_answers_screen_text_with_quotes_and_backslashes_in_the_schema():
    """The schema admits no `"` or `\\`: DeskEye's OCR engine quotes them as ' and / rather than fail its own schema."""
    from inference_worker.engines.ocr.concepts import describe
    from inference_worker.engines.ocr.engine import render_answer
    from inference_worker.engines.ocr.reader import OcrLine

    lines = [OcrLine('Traceback (most recent call last):', (0, 0, 900, 20), 0.9),
             OcrLine('File "C:\\app\\main.py", line 3', (0, 30, 900, 50), 0.9)]
    described = describe(lines, 600)
    assert described.matches                                      # still read as a traceback: matching sees the quotes
    answer = json.loads(render_answer(described, DESKEYE_SCHEMA))
    jsonschema.validate(answer, DESKEYE_SCHEMA)
    assert "“File 'C:/app/main.py', line 3”" in answer["summary"]
