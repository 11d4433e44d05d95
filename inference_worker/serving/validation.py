"""Structured output you can rely on: validate the engine's JSON against the request's schema and retry.

A grammar makes invalid output unlikely, not impossible (a token limit can cut the JSON short, and an engine
may have no grammar at all). So every answer to a request with a schema is parsed and validated; a cut-off
or invalid answer is generated again, first with twice the tokens (capped at the worker's limit), then
greedily, up to `max_retries` times (the service re-queues the attempt, see service.py); if none is valid the
request is answered 502.

Schemas are untrusted: `schemas.py` checks and compiles each one once (local `$ref`s only, size and depth caps,
RE2 patterns, a step budget per validation) and keeps it in a byte-bounded cache shared by the whole worker.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from inference_worker.protocol import ChatRequest, Completion
from inference_worker.serving.schemas import CompiledSchema, SchemaCache

_SCHEMAS = SchemaCache()


def check_schema(schema: dict[str, Any]) -> None:
    """Raise ProtocolError (400) when the request's schema is not a JSON Schema this worker will run; compiles
    and caches it, so checking it first (off the model thread) makes validating its answers cheap."""
    compiled_schema(schema)


def compiled_schema(schema: dict[str, Any]) -> CompiledSchema:
    return _SCHEMAS.get(schema)


def schema_problem(data: Any, schema: dict[str, Any]) -> str | None:
    """Why decoded JSON `data` does not match `schema`, or None; ProtocolError (400) for a schema refused."""
    return compiled_schema(schema).first_error(data)


def output_problem(completion: Completion, schema: dict[str, Any]) -> str | None:
    """Why this output is not acceptable for `schema`, or None when it is."""
    if completion.finish_reason == "length":
        return f"the answer was cut off at {completion.completion_tokens} tokens"
    try:
        data = json.loads(completion.text)
    except json.JSONDecodeError as exc:
        return f"the answer is not JSON ({exc.msg} at char {exc.pos})"
    except RecursionError:
        return "the answer nests too deep to read"
    return schema_problem(data, schema)


def retry_request(request: ChatRequest, retry: int, max_tokens_limit: int) -> ChatRequest:
    """The request for retry number `retry` (1, 2, ...): twice the tokens each time, greedy from the 2nd."""
    sampling = request.sampling
    max_tokens = min(max_tokens_limit, sampling.max_tokens * 2 ** retry)
    temperature = sampling.temperature if retry < 2 else 0.0
    return dataclasses.replace(request, sampling=dataclasses.replace(
        sampling, max_tokens=max_tokens, temperature=temperature))
