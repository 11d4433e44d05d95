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
import time
import urllib.parse
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import jsonschema
import re2
import referencing
import referencing.exceptions
from jsonschema.validators import extend, validator_for

from inference_worker.protocol import ProtocolError

PARAM = "response_format"
WHERE = "response_format.json_schema.schema"

#: keywords whose value is a schema / a list of schemas / an object of schemas (every draft from 3 to 2020-12)
SINGLE_SCHEMA_KEYWORDS = ("additionalProperties", "additionalItems", "contains", "propertyNames", "not", "if",
                          "then", "else", "unevaluatedItems", "unevaluatedProperties", "contentSchema", "items")
SCHEMA_LIST_KEYWORDS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
SCHEMA_MAP_KEYWORDS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
                       "dependencies")
#: keywords that apply their subschemas to the same part of the answer (a cycle through these never ends)
IN_PLACE_KEYWORDS = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else", "dependentSchemas", "dependencies")
REFUSED_KEYWORDS = {
    "$id": "remove '$id': this worker resolves only local references ('#/...') and names no schema resources",
    "$dynamicRef": "use '$ref' with a local JSON pointer ('#/$defs/name') instead of '$dynamicRef'",
    "$recursiveRef": "use '$ref' with a local JSON pointer ('#' or '#/$defs/name') instead of '$recursiveRef'",
}


@dataclass(frozen=True)
class SchemaLimits:
    """Caps on what one request's schema may cost. Defaults fit any realistic structured-output schema
    (OpenAI's own: 5,000 properties, 10 levels); `max_cache_bytes` bounds what compiled schemas keep."""
    max_bytes: int = 256 * 1024                # the schema as compact JSON
    max_depth: int = 64                        # JSON nesting (objects and arrays), ~32 schema levels
    max_nodes: int = 20_000                    # objects, arrays and scalars in the schema
    max_pattern_chars: int = 1_000
    max_pattern_memory_bytes: int = 1 << 20    # RE2's compile budget per pattern
    max_validation_steps: int = 200_000        # keyword evaluations while validating one answer
    max_validation_ms: int = 250               # and the time they may take (legitimate schemas need ~1 ms)
    max_in_place_expansion: int = 10_000       # subschemas $ref/allOf/anyOf/... apply to one value, expanded
    max_answer_depth: int = 64                 # nesting of the answer validated against a schema
    max_cache_bytes: int = 32 * 1024 * 1024

    def __post_init__(self):
        for name, value in vars(self).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"SchemaLimits.{name} must be a positive integer; got {value!r}")


DEFAULT_LIMITS = SchemaLimits()


class ValidationBudgetExceeded(RuntimeError):
    """Validating one answer took more keyword evaluations than `SchemaLimits.max_validation_steps`, or longer
    than `max_validation_ms`."""


def refuse(message: str) -> ProtocolError:
    return ProtocolError(f"{WHERE}: {message}", param=PARAM)


# ------------------------------------------------------------------ the compiled schema

@dataclass(frozen=True)
class CompiledSchema:
    """A checked schema with its validator; `num_bytes` is what keeping it costs (see `_held_bytes`)."""
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
        _STEPS.left, _STEPS.deadline_s = self.max_steps, time.monotonic() + self.max_seconds
        try:
            error = jsonschema.exceptions.best_match(self.validator.iter_errors(data))
        except ValidationBudgetExceeded:
            return (f"checking the answer against the schema took more than {self.max_steps:,} steps or "
                    f"{self.max_seconds:g} s; simplify the schema (fewer nested anyOf/oneOf/$ref)")
        except RecursionError:
            return "checking the answer against the schema nested too deep"
        finally:
            _STEPS.left = None
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
    walk = _SchemaWalk(schema, legacy_id=cls is jsonschema.Draft4Validator,
                       max_expansion=limits.max_in_place_expansion)
    walk.run()
    patterns = {p: compile_pattern(p, where, limits) for p, where in walk.patterns.items()}
    _check_against_metaschema(cls, schema)
    validator = _safe_validator_class(cls, patterns)(schema, registry=REFUSING_REGISTRY)
    return CompiledSchema(validator, _held_bytes(text, patterns), limits.max_validation_steps,
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


# ------------------------------------------------------------------ references and patterns

class _SchemaWalk:
    """Every subschema reachable from the root (through schema keywords and local `$ref`s): refuses remote or
    broken references and refused keywords, gathers the patterns, and finds in-place `$ref` loops."""

    def __init__(self, root: dict, *, legacy_id: bool, max_expansion: int):
        self.root = root
        self.max_expansion = max_expansion
        self.legacy_id = legacy_id                       # draft 4 names resources with "id"
        self.patterns: dict[str, str] = {}               # pattern -> where it was first seen
        self._in_place: dict[int, list[tuple[int, str]]] = {}   # node -> [(node, where)] applied in place
        self._where: dict[int, str] = {}
        self._nodes: dict[int, dict] = {}
        self.has_pattern_properties = False
        self.has_unevaluated_properties = False

    def run(self) -> None:
        stack = [(self.root, "#")]
        while stack:
            node, where = stack.pop()
            if id(node) in self._nodes:
                continue
            self._nodes[id(node)] = node
            self._where[id(node)] = where
            stack.extend(self._visit(node, where))
        self._refuse_loops()
        if self.has_pattern_properties and self.has_unevaluated_properties:
            # jsonschema matches patternProperties with Python's backtracking `re` inside unevaluatedProperties
            raise refuse("'unevaluatedProperties' together with 'patternProperties' is not supported; use "
                         "'additionalProperties' beside 'patternProperties' instead.")

    def _visit(self, node: dict, where: str) -> Iterator[tuple[dict, str]]:
        for keyword, advice in REFUSED_KEYWORDS.items():
            if keyword in node:
                raise refuse(f"'{keyword}' at {where}: {advice}.")
        if self.legacy_id and isinstance(node.get("id"), str):
            raise refuse(f"'id' at {where}: {REFUSED_KEYWORDS['$id'].replace('$id', 'id')}.")
        edges = self._in_place.setdefault(id(node), [])
        ref = node.get("$ref")
        if isinstance(ref, str):
            target = self._resolve(ref, f"{where}/$ref")
            if isinstance(target, dict):
                edges.append((id(target), f"{where}/$ref"))
                yield target, ref
        if isinstance(node.get("pattern"), str):
            self.patterns.setdefault(node["pattern"], f"{where}/pattern")
        if isinstance(node.get("patternProperties"), dict):
            self.has_pattern_properties = True
            for pattern in node["patternProperties"]:
                self.patterns.setdefault(pattern, f"{where}/patternProperties")
        if "unevaluatedProperties" in node:
            self.has_unevaluated_properties = True
        for child, child_where, keyword in _subschemas(node, where):
            if keyword in IN_PLACE_KEYWORDS:
                edges.append((id(child), child_where))
            yield child, child_where

    def _resolve(self, ref: str, where: str) -> Any:
        if not (ref == "#" or ref.startswith("#/")):
            shown = ref if len(ref) <= 120 else ref[:117] + "..."
            raise refuse(f"'$ref' at {where} is {shown!r}; only local references into this schema are allowed "
                         "('#' or '#/$defs/name'): the worker never fetches or reads a referenced schema.")
        node: Any = self.root
        for token in ref[2:].split("/") if ref != "#" else ():
            key = urllib.parse.unquote(token).replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and key in node:
                node = node[key]
            elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
                node = node[int(key)]
            else:
                raise refuse(f"'$ref' at {where} ({ref[:120]!r}) points to nothing in this schema; "
                             "point it at a schema under '$defs'.")
        return node

    def _refuse_loops(self) -> None:
        """A cycle of in-place edges ($ref, allOf, anyOf, ...) would validate forever on the same value; a chain
        of them that fans out (`a: anyOf [b, b]`, `b: anyOf [c, c]`, ...) would take exponential time."""
        state: dict[int, int] = {}                       # 1 = on the current path, 2 = done
        expansion: dict[int, int] = {}                   # subschemas applied to one value from this node
        for start in self._in_place:
            if state.get(start):
                continue
            path = [(start, iter(self._in_place.get(start, ())))]
            state[start] = 1
            while path:
                node, edges = path[-1]
                edge = next(edges, None)
                if edge is None:
                    state[node] = 2
                    path.pop()
                    expansion[node] = 1 + sum(expansion[child] for child, _ in self._in_place.get(node, ()))
                    if expansion[node] > self.max_expansion:
                        raise refuse(f"at {self._where.get(node, '#')}, '$ref'/'allOf'/'anyOf'/'oneOf' expand to "
                                     f"more than {self.max_expansion:,} subschemas applied to the same value; "
                                     "simplify the schema (fewer nested references to references).")
                    continue
                child, where = edge
                if state.get(child) == 1:
                    raise refuse(f"'$ref' loop: {where} leads back to {self._where.get(child, '#')} without "
                                 "reading any part of the answer, so validation would never end; a recursive "
                                 "schema must recurse through 'properties' or 'items'.")
                if not state.get(child):
                    state[child] = 1
                    path.append((child, iter(self._in_place.get(child, ()))))


def _subschemas(node: dict, where: str) -> Iterator[tuple[dict, str, str]]:
    """(subschema, where, keyword) for each object-valued subschema of `node` (booleans hold nothing to walk)."""
    for keyword in SINGLE_SCHEMA_KEYWORDS:
        if isinstance(node.get(keyword), dict):
            yield node[keyword], f"{where}/{keyword}", keyword
    for keyword in SCHEMA_LIST_KEYWORDS:
        if isinstance(node.get(keyword), list):
            for i, child in enumerate(node[keyword]):
                if isinstance(child, dict):
                    yield child, f"{where}/{keyword}/{i}", keyword
    for keyword in SCHEMA_MAP_KEYWORDS:
        if isinstance(node.get(keyword), dict):
            for name, child in node[keyword].items():
                if isinstance(child, dict):
                    yield child, f"{where}/{keyword}/{name}", keyword


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


# ------------------------------------------------------------------ the validator

def _refuse_retrieval(uri: str):
    raise referencing.exceptions.NoSuchResource(ref=uri)


#: every reference the validator cannot find inside the schema stays unresolved: nothing is fetched or read
REFUSING_REGISTRY = referencing.Registry(retrieve=_refuse_retrieval)
_STEPS = threading.local()


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


def _safe_validator_class(cls, patterns: dict[str, Any]):
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


def _held_bytes(schema_json: str, patterns: dict[str, Any]) -> int:
    """What a cached schema keeps in RSS: the parsed schema and its validator (measured 3.5 bytes per byte of
    compact JSON for a 226 KB schema), RE2's programs (measured ~12 bytes per instruction) and a fixed part;
    rounded up, so the cache's count never falls below what it holds."""
    return 4096 + 4 * len(schema_json.encode("utf-8")) + sum(16 * p.programsize for p in patterns.values())


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

