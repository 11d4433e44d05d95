"""Structured output you can rely on: validate the engine's JSON against the request's schema and retry.

A grammar makes invalid output unlikely, not impossible (a token limit can cut the JSON short, and an engine
may have no grammar at all). So every answer to a request with a schema is parsed and validated; a cut-off
or invalid answer is generated again, first with twice the tokens (capped at the worker's limit), then
greedily, up to `max_retries` times (the service re-queues the attempt, see service.py); if none is valid the
request is answered 502.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

import jsonschema
from jsonschema.validators import validator_for

from inference_worker.protocol import ChatRequest, Completion, ProtocolError

MAX_CACHED_VALIDATORS = 64


def check_schema(schema: dict[str, Any]) -> None:
    """Raise ProtocolError (400) when the request's schema is not a valid JSON Schema."""
    try:
        _validator(_schema_key(schema))
    except jsonschema.SchemaError as exc:
        raise ProtocolError(f"response_format.json_schema.schema is not a valid JSON Schema: {exc.message}",
                            param="response_format") from None


def output_problem(completion: Completion, schema: dict[str, Any]) -> str | None:
    """Why this output is not acceptable for `schema`, or None when it is."""
    if completion.finish_reason == "length":
        return f"the answer was cut off at {completion.completion_tokens} tokens"
    try:
        data = json.loads(completion.text)
    except json.JSONDecodeError as exc:
        return f"the answer is not JSON ({exc.msg} at char {exc.pos})"
    error = jsonschema.exceptions.best_match(_validator(_schema_key(schema)).iter_errors(data))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        return f"the answer does not match the schema at {where}: {error.message[:200]}"
    return None


def retry_request(request: ChatRequest, retry: int, max_tokens_limit: int) -> ChatRequest:
    """The request for retry number `retry` (1, 2, ...): twice the tokens each time, greedy from the 2nd."""
    sampling = request.sampling
    max_tokens = min(max_tokens_limit, sampling.max_tokens * 2 ** retry)
    temperature = sampling.temperature if retry < 2 else 0.0
    return dataclasses.replace(request, sampling=dataclasses.replace(
        sampling, max_tokens=max_tokens, temperature=temperature))


def _schema_key(schema: dict[str, Any]) -> str:
    return json.dumps(schema, sort_keys=True)


@functools.lru_cache(maxsize=MAX_CACHED_VALIDATORS)
def _validator(schema_json: str):
    schema = json.loads(schema_json)
    cls = validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)
