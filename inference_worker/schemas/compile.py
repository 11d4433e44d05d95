"""A request's JSON Schema made safe to hold and to run: checked once, compiled once, kept in a byte-bounded cache.

A schema is untrusted request content. Before anything runs it:
- its size and nesting are capped (`SchemaLimits`), walked without recursion;
- `$ref` may only point inside the schema (`#` or `#/json/pointer`); `$id`, `$dynamicRef` and `$recursiveRef`
  are refused, and the validator's `referencing` registry refuses every retrieval, so nothing is ever fetched
  or read from disk (jsonschema's default registry would fetch remote `$ref`s);
- a `$ref` chain that comes back to itself without reading any part of the answer (a loop) is refused;
- every `pattern` and `patternProperties` key is compiled by RE2, a linear-time engine; a pattern RE2 cannot
  run (lookaround, backreferences) is refused, and validation matches with RE2, never with Python's `re`;
- validating one answer has a step budget, so no schema/answer pair can keep the model thread busy.

Every refusal is a ProtocolError (400) that names the place in the schema, what is wrong and how to fix it.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import jsonschema
from jsonschema.validators import validator_for

from inference_worker.schemas.limits import DEFAULT_LIMITS, SchemaLimits, ValidationBudgetExceeded, refuse
from inference_worker.schemas.safe_validator import (REFUSING_REGISTRY, compile_pattern, held_bytes,
                                                      safe_validator_class, validation_budget)
from inference_worker.schemas.walk import SchemaWalk

# ------------------------------------------------------------------ the compiled schema

@dataclass(frozen=True)
class CompiledSchema:
    """A checked schema with its validator; `num_bytes` is what keeping it costs (see `held_bytes`)."""
    validator: Any
    num_bytes: int
    max_steps: int
    max_seconds: float
    max_answer_depth: int

    def first_error(self, data: Any) -> str | None:
        """Why `data` does not match, or None when it does; bounded in time and stack whatever the pair."""
        depth = json_depth(data, self.max_answer_depth)
        if depth > self.max_answer_depth:
            return f"the answer nests deeper than {self.max_answer_depth} levels"
        try:
            with validation_budget(self.max_steps, self.max_seconds):
                error = jsonschema.exceptions.best_match(self.validator.iter_errors(data))
        except ValidationBudgetExceeded:
            return (f"checking the answer against the schema took more than {self.max_steps:,} steps or "
                    f"{self.max_seconds:g} s; simplify the schema (fewer nested anyOf/oneOf/$ref)")
        except RecursionError:
            return "checking the answer against the schema nested too deep"
        if error is None:
            return None
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        return f"the answer does not match the schema at {where}: {error.message[:200]}"


def compile_schema(schema: Any, limits: SchemaLimits = DEFAULT_LIMITS) -> CompiledSchema:
    """Check `schema` (raises ProtocolError 400 naming the problem) and build its validator."""
    if not isinstance(schema, dict):
        raise refuse("must be a JSON object.")
    _check_shape(schema, limits)
    text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    _check_size(text, limits)
    cls = _dialect(schema)
    walk = SchemaWalk(schema, legacy_id=cls is jsonschema.Draft4Validator,
                       max_expansion=limits.max_in_place_expansion)
    walk.run()
    patterns = {p: compile_pattern(p, where, limits) for p, where in walk.patterns.items()}
    _check_against_metaschema(cls, schema)
    validator = safe_validator_class(cls, patterns)(schema, registry=REFUSING_REGISTRY)
    return CompiledSchema(validator, held_bytes(text, patterns), limits.max_validation_steps,
                          limits.max_validation_ms / 1000, limits.max_answer_depth)


def _check_shape(schema: dict, limits: SchemaLimits) -> None:
    """Depth and node count, iteratively (a deep schema must not reach a recursive walker)."""
    stack: list[tuple[Any, int]] = [(schema, 1)]
    num_nodes = 0
    while stack:
        node, depth = stack.pop()
        num_nodes += 1
        if num_nodes > limits.max_nodes:
            raise refuse(f"has more than {limits.max_nodes:,} values; send a smaller schema.")
        if depth > limits.max_depth:
            raise refuse(f"nests deeper than {limits.max_depth} levels of objects and arrays; "
                         "flatten it or name repeated parts in '$defs'.")
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children)


def _check_size(schema_json: str, limits: SchemaLimits) -> None:
    num_bytes = len(schema_json.encode("utf-8", "surrogatepass"))
    if num_bytes > limits.max_bytes:
        raise refuse(f"is {num_bytes:,} bytes as JSON; this worker accepts schemas of at most "
                     f"{limits.max_bytes:,} bytes (move repeated parts into '$defs' and use '$ref').")


def json_depth(data: Any, stop_after: int) -> int:
    """Nesting depth of decoded JSON (a scalar is 0), counted without recursion; stops past `stop_after`."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(data, 0)]
    while stack and deepest <= stop_after:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth + 1)
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


_UNKNOWN_DIALECT = object()


def _dialect(schema: dict):
    declared = schema.get("$schema")
    if declared is None:
        return jsonschema.Draft202012Validator
    if not isinstance(declared, str):
        raise refuse("'$schema' must be a string naming a JSON Schema draft.")
    cls = validator_for(schema, default=_UNKNOWN_DIALECT)
    if cls is _UNKNOWN_DIALECT:
        raise refuse(f"'$schema' {declared[:100]!r} is not a JSON Schema draft this worker knows; use "
                     "'https://json-schema.org/draft/2020-12/schema' (or leave '$schema' out).")
    if cls is jsonschema.Draft3Validator:
        raise refuse("JSON Schema draft 3 is not supported; use draft 2020-12 (or leave '$schema' out).")
    return cls


def _check_against_metaschema(cls, schema: dict) -> None:
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise refuse(f"is not a valid JSON Schema at {where}: {exc.message[:300]}") from None
    except RecursionError:
        raise refuse("nests too deep to check; flatten it or name repeated parts in '$defs'.") from None


# ------------------------------------------------------------------ the cache

class SchemaCache:
    """Compiled schemas by content, least recently used dropped first, bounded by `max_bytes` (not by count)."""

    def __init__(self, limits: SchemaLimits = DEFAULT_LIMITS):
        self.limits = limits
        self.max_bytes = limits.max_cache_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[bytes, CompiledSchema] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, schema: Any) -> CompiledSchema:
        key = _content_key(schema, self.limits)
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                return found
        compiled = compile_schema(schema, self.limits)
        self._put(key, compiled)
        return compiled

    def _put(self, key: bytes, compiled: CompiledSchema) -> None:
        if compiled.num_bytes > self.max_bytes:
            return
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = compiled
            self.num_bytes += compiled.num_bytes
            while self.num_bytes > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self.num_bytes -= dropped.num_bytes


def _content_key(schema: Any, limits: SchemaLimits) -> bytes:
    if isinstance(schema, dict):
        _check_shape(schema, limits)                   # json.dumps recurses: check depth first
    try:
        text = json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise refuse(f"is not plain JSON ({exc}).") from None
    _check_size(text, limits)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()

