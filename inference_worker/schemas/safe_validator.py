"""The validator a compiled schema runs: patterns matched by RE2 (linear time, never Python's `re`), every keyword
counted against a step and time budget, and a registry that resolves nothing outside the schema."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import jsonschema
import re2
import referencing
import referencing.exceptions
from jsonschema.validators import extend

from inference_worker.errors import ProtocolError
from inference_worker.schemas.limits import DEFAULT_LIMITS, SchemaLimits, ValidationBudgetExceeded, refuse


def compile_pattern(pattern: str, where: str = "pattern", limits: SchemaLimits = DEFAULT_LIMITS):
    """`pattern` (ECMA-262 syntax, as JSON Schema writes it) compiled by RE2, or a 400 naming why not."""
    if len(pattern) > limits.max_pattern_chars:
        raise refuse(f"the pattern at {where} is {len(pattern):,} characters; at most "
                     f"{limits.max_pattern_chars:,} are accepted.")
    options = re2.Options()
    options.max_mem = limits.max_pattern_memory_bytes
    options.log_errors = False
    try:
        return re2.compile(_re2_syntax(pattern), options)
    except re2.error as exc:
        reason = exc.args[0].decode("utf-8", "replace") if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise refuse(f"the pattern at {where} ({pattern[:80]!r}) cannot run in a linear-time regex engine "
                     f"({reason[:120]}); rewrite it without lookaround, backreferences or huge repetition counts."
                     ) from None


def _re2_syntax(pattern: str) -> str:
    """ECMA-262's `\\uXXXX` and `\\u{X...}` escapes in RE2's `\\x{...}` spelling; everything else as written."""
    out: list[str] = []
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\" and i + 1 < len(pattern):
            escape = pattern[i + 1]
            digits = pattern[i + 2:i + 6]
            if escape == "u" and len(digits) == 4 and all(c in "0123456789abcdefABCDEF" for c in digits):
                out.append(f"\\x{{{digits}}}")
                i += 6
                continue
            if escape == "u" and pattern[i + 2:i + 3] == "{":
                end = pattern.find("}", i + 3)
                if end != -1:
                    out.append(f"\\x{{{pattern[i + 3:end]}}}")
                    i = end + 1
                    continue
            out.append(pattern[i:i + 2])
            i += 2
            continue
        out.append(char)
        i += 1
    return "".join(out)


def _refuse_retrieval(uri: str):
    raise referencing.exceptions.NoSuchResource(ref=uri)


#: every reference the validator cannot find inside the schema stays unresolved: nothing is fetched or read
REFUSING_REGISTRY = referencing.Registry(retrieve=_refuse_retrieval)
_STEPS = threading.local()


@contextmanager
def validation_budget(max_steps: int, max_seconds: float) -> Iterator[None]:
    """Within it, this thread's validator may evaluate `max_steps` keywords for `max_seconds`, then raises
    ValidationBudgetExceeded."""
    _STEPS.left, _STEPS.deadline_s = max_steps, time.monotonic() + max_seconds
    try:
        yield
    finally:
        _STEPS.left = None


def _spend_step() -> None:
    left = getattr(_STEPS, "left", None)
    if left is None:
        return
    if left <= 0 or (left % 64 == 0 and time.monotonic() > _STEPS.deadline_s):
        raise ValidationBudgetExceeded()
    _STEPS.left = left - 1


def _counted(keyword_fn: Callable) -> Callable:
    def run(validator, value, instance, schema):
        _spend_step()
        return keyword_fn(validator, value, instance, schema)
    return run


def _text(instance: str) -> str:
    try:
        instance.encode("utf-8")
        return instance
    except UnicodeEncodeError:                          # lone surrogates from JSON "\ud800" escapes
        return instance.encode("utf-8", "replace").decode("utf-8")


def safe_validator_class(cls, patterns: dict[str, Any]):
    """`cls` with its regex keywords matched by the schema's RE2 patterns and every keyword counted."""
    ValidationError = jsonschema.exceptions.ValidationError

    def search(pattern: str, text: str) -> bool:
        compiled = patterns.get(pattern)
        if compiled is None:                           # a place the walk did not reach: still RE2, never `re`
            try:
                compiled = patterns.setdefault(pattern, compile_pattern(pattern))
            except ProtocolError:
                return False
        return compiled.search(_text(text)) is not None

    def pattern(validator, patrn, instance, schema):
        if validator.is_type(instance, "string") and not search(patrn, instance):
            yield ValidationError(f"{instance[:80]!r} does not match {patrn[:80]!r}")

    def pattern_properties(validator, pattern_properties, instance, schema):
        if not validator.is_type(instance, "object"):
            return
        for patrn, subschema in pattern_properties.items():
            for key, value in instance.items():
                if search(patrn, key):
                    yield from validator.descend(value, subschema, path=key, schema_path=patrn)

    def additional_properties(validator, additional, instance, schema):
        if not validator.is_type(instance, "object"):
            return
        known = schema.get("properties", {})
        extras = sorted(key for key in instance if key not in known
                        and not any(search(p, key) for p in schema.get("patternProperties", {})))
        if validator.is_type(additional, "object"):
            for key in extras:
                yield from validator.descend(instance[key], additional, path=key)
        elif additional is False and extras:
            shown = ", ".join(repr(key[:40]) for key in extras[:5])
            yield ValidationError(f"Additional properties are not allowed ({shown} unexpected)")

    keywords = {name: _counted(fn) for name, fn in cls.VALIDATORS.items()}
    keywords.update({"pattern": _counted(pattern), "patternProperties": _counted(pattern_properties),
                     "additionalProperties": _counted(additional_properties)})
    return extend(cls, keywords)


def held_bytes(schema_json: str, patterns: dict[str, Any]) -> int:
    """What a cached schema keeps in RSS: the parsed schema and its validator (measured 3.5 bytes per byte of
    compact JSON for a 226 KB schema), RE2's programs (measured ~12 bytes per instruction) and a fixed part;
    rounded up, so the cache's count never falls below what it holds."""
    return 4096 + 4 * len(schema_json.encode("utf-8")) + sum(16 * p.programsize for p in patterns.values())
