"""The schema compiler and its cache (inference_worker/schemas/) in-process: what the attack tests in
test_attacks.py reach over HTTP, plus what only shows from inside — the byte bound of the cache, the registry that
refuses every retrieval, the validation budget, and RE2 spelling of ECMA-262 escapes."""

from __future__ import annotations

import copy
import json
import socket
import subprocess
import sys
import threading

import pytest
import referencing.exceptions

from inference_worker.protocol import ProtocolError
from deskeye.prompt import DESKEYE_SCHEMA
from inference_worker.schemas.compile import SchemaCache, SchemaLimits, compile_schema
from inference_worker.schemas.safe_validator import REFUSING_REGISTRY, compile_pattern

pytestmark = [pytest.mark.subprocess]


def test_the_validator_registry_refuses_every_retrieval_without_connecting():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    try:
        for uri in (f"http://127.0.0.1:{port}/s.json", "file:///etc/passwd", "https://json-schema.org/x.json"):
            with pytest.raises(referencing.exceptions.Unresolvable):
                REFUSING_REGISTRY.resolver().lookup(uri)
        with pytest.raises(OSError):
            listener.accept()                              # nobody connected
    finally:
        listener.close()
    validator = compile_schema(DESKEYE_SCHEMA).validator
    assert validator._registry is REFUSING_REGISTRY         # never jsonschema's default (remote-fetching) one


def test_deskeye_schema_compiles_and_its_control_character_bound_holds_in_re2():
    compiled = compile_schema(DESKEYE_SCHEMA)
    assert compiled.first_error({"summary": "A mail client", "key_objects": ["Inbox"]}) is None
    problem = compiled.first_error({"summary": "tab\there", "key_objects": []})
    assert problem.startswith("the answer does not match the schema at summary")
    assert compiled.first_error({"summary": "x" * 201, "key_objects": []}) is not None


@pytest.mark.parametrize("pattern, text, matches", [
    (r"^\u0041\u{1F600}?$", "A", True), (r"^\u0041$", "B", False), (r"\\u0041", "\\u0041", True),
    (r"^[^\u0000-\u001f]+$", "ok", True), (r"^\d{3}-\w+$", "123-abc", True),
])
def test_ecma_escapes_are_spelled_for_re2(pattern, text, matches):
    assert (compile_pattern(pattern).search(text) is not None) is matches


def test_a_pathological_pattern_is_matched_in_linear_time():
    compiled = compile_schema({"type": "string", "pattern": "^(a+)+$"})
    result: list = []
    worker = threading.Thread(target=lambda: result.append(compiled.first_error("a" * 100_000 + "!")), daemon=True)
    worker.start()
    worker.join(10)                                        # Python's re: ~2**100000 steps
    assert result and "does not match" in result[0]


def test_pattern_properties_and_additional_properties_use_re2():
    schema = {"type": "object", "patternProperties": {"^(a+)+$": {"type": "integer"}}, "additionalProperties": False}
    compiled = compile_schema(schema)
    assert compiled.first_error({"aaaa": 1}) is None
    assert "aaaa" in compiled.first_error({"aaaa": "one"}) or "integer" in compiled.first_error({"aaaa": "one"})
    assert "not allowed" in compiled.first_error({"a" * 5000 + "!": 1})
    with pytest.raises(ProtocolError, match="unevaluatedProperties"):
        compile_schema({**schema, "unevaluatedProperties": False})


def test_a_fan_out_of_references_is_refused_and_a_deep_answer_is_bounded():
    levels = {f"l{i}": {"anyOf": [{"$ref": f"#/$defs/l{i + 1}"}, {"$ref": f"#/$defs/l{i + 1}"}]} for i in range(30)}
    levels["l30"] = {"type": "string"}
    with pytest.raises(ProtocolError, match="expand to more than 10,000 subschemas"):
        compile_schema({"$defs": levels, "$ref": "#/$defs/l0"})
    doubling = {"$defs": {"n": {"allOf": [{"properties": {"x": {"$ref": "#/$defs/n"}}}] * 2}}, "$ref": "#/$defs/n"}
    deep: dict = {}
    for _ in range(40):
        deep = {"x": deep}
    assert "simplify the schema" in compile_schema(doubling).first_error(deep)      # bounded, not 2**40 steps
    nested: list = []
    for _ in range(500):
        nested = [nested]
    assert "nests deeper than 64 levels" in compile_schema({"type": "array"}).first_error(nested)


def big_schema(index: int, num_fields: int = 600) -> dict:
    return {"type": "object", "title": f"schema {index}", "properties": {
        f"field_{index}_{k}": {"type": "string", "description": f"field {k} of schema {index}: " + "d" * 280}
        for k in range(num_fields)}}


@pytest.mark.slow
def test_the_cache_is_bounded_by_bytes_not_by_count():
    limits = SchemaLimits(max_cache_bytes=4 * 2**20 // 10)   # a tenth of 4 MiB, as the schemas are a tenth
    cache = SchemaCache(limits)
    sizes = []
    for index in range(30):                               # ~20 KB of JSON each: ~85 KB counted
        compiled = cache.get(big_schema(index, num_fields=60))
        sizes.append(compiled.num_bytes)
        assert cache.num_bytes <= limits.max_cache_bytes
    assert len(cache) < 30 and cache.num_bytes == sum(sizes[-len(cache):])
    last = big_schema(29, num_fields=60)
    assert cache.get(last) is cache.get(copy.deepcopy(last))                           # by content
    small = SchemaCache()
    for index in range(300):
        small.get({**DESKEYE_SCHEMA, "title": f"t{index}"})
    assert len(small) == 300                              # small schemas: many fit


COST = """
import gc, json, sys
import psutil
sys.path.insert(0, sys.argv[1])
from tests.test_schemas import big_schema
from inference_worker.schemas import compile_schema
process = psutil.Process()
big_schema(99)                      # warm up
gc.collect()
before = process.memory_info().rss
kept = [compile_schema(big_schema(i)) for i in range(12)]   # each keeps its schema, as a cached one does
gc.collect()
print(json.dumps({"real_per_schema": (process.memory_info().rss - before) / len(kept),
                  "counted_per_schema": sum(k.num_bytes for k in kept) / len(kept)}))
"""


@pytest.mark.slow
def test_what_a_cached_schema_counts_covers_what_it_holds():
    """In a fresh process: RSS kept by compiled schemas (the parsed schema, which the cache keeps alive after its
    request, and the validator) is at most what the cache counts for them."""
    root = str(__import__("pathlib").Path(__file__).resolve().parents[1])
    done = subprocess.run([sys.executable, "-c", COST, root], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["real_per_schema"] <= report["counted_per_schema"], report
    assert report["counted_per_schema"] <= 3 * report["real_per_schema"], report      # not wildly over
