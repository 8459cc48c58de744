"""What the router checks of a JSON schema before a worker compiles it into a grammar.

Two things, both answered with a 400 that names the field and the keyword or limit:
- keywords the grammar engine (xgrammar) does not enforce. Accepting them would promise output
  that the grammar does not guarantee, so they are refused (docs/edge.md lists them);
- schemas whose compile cost is predictably too high: the compile time grows about cubically
  with the nesting depth (0.5 s at depth 100, 11.7 s at 300 on the attack run of issue 39), so
  the depth and the number of subschemas are bounded here, before any worker spends time on it.

Plain data in, an error or nothing out; it never reaches a worker and never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from router.errors import invalid_request

# keyword -> why it is refused (what xgrammar 0.2 does with it: nothing, or less than JSON
# Schema says). Checked on xgrammar 0.2.8 with a schema that the keyword should refuse.
UNENFORCED: dict[str, str] = {
    "allOf": "allOf of more than one branch (every branch at once) is not enforced",
    "not": "a negated schema is not enforced",
    "if": "conditional schemas (if/then/else) are not enforced",
    "then": "conditional schemas (if/then/else) are not enforced",
    "else": "conditional schemas (if/then/else) are not enforced",
    "uniqueItems": "unique array items are not enforced",
    "contains": "contains (and minContains/maxContains) is not enforced",
    "minContains": "contains (and minContains/maxContains) is not enforced",
    "maxContains": "contains (and minContains/maxContains) is not enforced",
    "dependentRequired": "dependent required properties are not enforced",
    "dependentSchemas": "dependent schemas are not enforced",
    "dependencies": "dependent properties are not enforced",
    "contentEncoding": "content encodings are not enforced",
    "contentMediaType": "content media types are not enforced",
    "contentSchema": "content schemas are not enforced",
}

# keywords whose value is one subschema / a list of them / a name -> subschema map
_ONE = ("items", "additionalProperties", "propertyNames", "additionalItems",
        "unevaluatedItems", "unevaluatedProperties")
_LIST = ("prefixItems", "anyOf", "oneOf", "allOf")
_MAP = ("properties", "patternProperties", "$defs", "definitions")


@dataclass(frozen=True)
class SchemaLimits:
    """Bounds on a schema's shape that keep a worker's compile under a second. Measured with
    xgrammar 0.2.8 on a 30k-entry vocabulary (2 compile threads, cache off): nesting depth 32
    0.02 s, 64 0.13 s, 100 0.42 s; one object of 500 optional properties 0.6 s, of 2,000
    72 s (optional properties cost superlinearly; required ones ten times less)."""

    max_depth: int = 32      # nesting of subschemas (an object in an array in an object: 3)
    max_nodes: int = 512     # subschemas in all, $defs included

    def __post_init__(self) -> None:
        assert self.max_depth >= 1 and self.max_nodes >= 1


def check_schema(schema: Any, param: str, limits: SchemaLimits = SchemaLimits()) -> None:
    """Raise a 400 (ApiError) naming ``param``, the path and the keyword or limit when
    ``schema`` uses a keyword the grammar does not enforce or is past ``limits``. Iterative, so
    a deep schema cannot exhaust the stack."""
    nodes = 0
    todo: list[tuple[Any, str, int]] = [(schema, "", 1)]
    while todo:
        node, path, depth = todo.pop()
        if isinstance(node, bool):
            continue  # true / false are schemas too
        if not isinstance(node, dict):
            raise invalid_request(f"{param}{path}: a schema must be an object or a boolean, "
                                  f"got {type(node).__name__}", param)
        nodes += 1
        if nodes > limits.max_nodes:
            raise invalid_request(f"{param}: the schema has more than {limits.max_nodes} "
                                  "subschemas, the limit (its grammar would take too long to "
                                  "build)", param, "schema_too_large")
        if depth > limits.max_depth:
            raise invalid_request(f"{param}{path}: the schema nests deeper than "
                                  f"{limits.max_depth} levels, the limit (its grammar would take "
                                  "too long to build)", param, "schema_too_deep")
        for key in node:
            if key == "allOf" and isinstance(node[key], list) and len(node[key]) == 1:
                continue  # one branch is that branch, and enforced (pydantic v1 writes these)
            if key in UNENFORCED:
                raise invalid_request(f"{param}{path}: the keyword {key!r} is not supported: "
                                      f"{UNENFORCED[key]} by this server's grammar engine",
                                      param, "unsupported_schema_keyword")
        kind = node.get("type")
        if isinstance(kind, list) and not kind:
            raise invalid_request(f"{param}{path}: \"type\": [] allows no value; name at least "
                                  "one type", param, "unsupported_schema_keyword")
        for key in _ONE:
            if key in node:
                todo.append((node[key], f"{path}.{key}", depth + 1))
        for key in _LIST:
            items = node.get(key)
            if isinstance(items, list):
                todo.extend((s, f"{path}.{key}[{i}]", depth + 1) for i, s in enumerate(items))
        for key in _MAP:
            named = node.get(key)
            if isinstance(named, dict):
                todo.extend((s, f"{path}.{key}.{name}", depth + 1) for name, s in named.items())
