"""Walk a schema before it runs: every subschema reachable from the root (through schema keywords and local
`$ref`s). Refuses remote or broken references, refused keywords and in-place `$ref` loops, and gathers the
patterns the validator will run (compiled by RE2, safe_validator.py)."""

from __future__ import annotations

import urllib.parse
from typing import Any, Iterator

from inference_worker.schemas.limits import refuse

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



class SchemaWalk:
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
