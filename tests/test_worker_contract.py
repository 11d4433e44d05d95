"""Contract fuzzing (issue 11): schemathesis generates requests from the worker's own /openapi.json and sends
them to a real worker subprocess (tiny random Idefics3 model, grammar on). No answer may be a 5xx (an answer the 8
tokens cannot finish comes back with finish_reason "length"), every error must be in the worker's JSON error shape,
and the worker serves a good request afterwards.

Bounded so it stays within a minute or two on a 2-core machine: a few hundred examples over all operations,
--max-tokens-limit 8 so an accepted request decodes at most 8 tokens.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import schemathesis
from schemathesis import GenerationMode
from hypothesis import HealthCheck, Phase, given, settings

from tests.fixtures.worker import running_worker
from tests.test_worker_api import image_message, png_bytes

pytestmark = [pytest.mark.model, pytest.mark.subprocess]

MAX_CHAT_EXAMPLES = 300                   # POST /v1/chat/completions: the operation that takes client input
MAX_OTHER_EXAMPLES = 20                   # each GET (no parameters: headers and the key only)
ERROR_FIELDS = {"message", "type", "param", "code"}
fuzzed: list[int] = []


@pytest.fixture(scope="module")
def fuzz_worker(tiny_idefics3_dir, tmp_path_factory):
    args = ["--engine", "transformers", "--model", str(tiny_idefics3_dir), "--threads", "1",
            "--max-tokens-limit", "8", "--max-retries", "0", "--request-timeout-s", "60"]
    with running_worker(args, tmp_path_factory.mktemp("fuzz_worker")) as handle:
        yield handle


@pytest.mark.slow
def test_fuzzed_requests_never_get_a_5xx_and_errors_have_the_json_shape(fuzz_worker):
    auth = {"Authorization": f"Bearer {fuzz_worker.api_key}"}
    schema = schemathesis.openapi.from_url(f"{fuzz_worker.url}/openapi.json", headers=auth)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /v1/chat/completions", "GET /health"}
    for operation in operations:
        fuzz(operation, GenerationMode.POSITIVE, auth)
        if operation.label == "POST /v1/chat/completions":   # the GETs have no input to break
            fuzz(operation, GenerationMode.NEGATIVE, auth)
    print(f"fuzzed {len(fuzzed)} requests over {len(operations)} operations: statuses {dict(Counter(fuzzed))}")
    assert len(fuzzed) >= MAX_CHAT_EXAMPLES * 1.5


def fuzz(operation, mode: GenerationMode, auth: dict[str, str]) -> None:
    is_chat = operation.label == "POST /v1/chat/completions"
    num_examples = MAX_CHAT_EXAMPLES if is_chat else MAX_OTHER_EXAMPLES
    num_examples //= 1 if mode is GenerationMode.POSITIVE else 2

    @given(case=operation.as_strategy(mode))
    @settings(max_examples=num_examples, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def check(case) -> None:
        response = case.call(headers=auth, timeout=60)
        fuzzed.append(response.status_code)
        assert response.status_code < 500, (operation.label, response.status_code, response.text[:500], case.body)
        if response.status_code >= 400:
            content_type = {k.lower(): v for k, v in response.headers.items()}.get("content-type")
            content_type = content_type[0] if isinstance(content_type, list) else content_type
            assert content_type and content_type.startswith("application/json"), (response.status_code,
                                                                                   response.headers)
            error = json.loads(response.content)["error"]
            assert set(error) == ERROR_FIELDS and error["code"] == response.status_code, error
            assert isinstance(error["message"], str) and error["message"]
    check()


@pytest.mark.slow
def test_the_worker_serves_a_good_request_after_the_fuzzing(fuzz_worker):
    client = fuzz_worker.openai_client()
    answer = client.chat.completions.create(model="deskeye", messages=image_message("What is this?", png_bytes()),
                                            max_tokens=4)
    assert answer.choices[0].message.role == "assistant" and answer.usage.completion_tokens >= 1
    metrics = fuzz_worker.metrics()
    server_errors = {k: v for k, v in metrics.items() if k.startswith('deskeye_worker_requests_total{code="5')
                     and k != 'deskeye_worker_requests_total{code="503",route="/health"}'}   # while it loaded
    assert not server_errors, server_errors
