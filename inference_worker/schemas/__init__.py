"""Structured output you can rely on: check a request's JSON Schema, and validate an answer against it.

A grammar makes invalid output unlikely, not impossible (a token limit can cut the JSON short, and an engine
may have no grammar at all). So every answer to a request with a schema is parsed and validated here; the
service generates a cut-off or invalid answer again (serving/retry.py) and answers 502 when none is valid.

Schemas are untrusted: `compile.py` checks and compiles each one once (local `$ref`s only, size and depth caps,
RE2 patterns, a step budget per validation; walk.py, safe_validator.py) and keeps it in a byte-bounded cache
shared by the whole worker. Every layer may use this package (the server checks a schema before queueing it,
the OCR engine fits its answer to one, the service validates answers); it imports none of them.
"""

from __future__ import annotations

import json
from typing import Any

from inference_worker.protocol import Completion
from inference_worker.schemas.compile import CompiledSchema, SchemaCache, compile_schema
from inference_worker.schemas.limits import SchemaLimits

__all__ = ["CompiledSchema", "SchemaCache", "SchemaLimits", "check_schema", "compile_schema", "compiled_schema",
           "output_problem", "schema_problem"]

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
