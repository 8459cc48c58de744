"""The router's schema check: keywords the grammar does not enforce are refused wherever they
sit in the schema (and only as keywords, never as property names); depth and size are bounded
without recursion."""

from __future__ import annotations

import pytest

from router.errors import ApiError
from router.schema_check import UNENFORCED, SchemaLimits, check_schema


def refused(schema, limits: SchemaLimits = SchemaLimits()) -> ApiError:
    with pytest.raises(ApiError) as info:
        check_schema(schema, "response_format.json_schema.schema", limits)
    assert info.value.status == 400
    assert info.value.param == "response_format.json_schema.schema"
    return info.value


@pytest.mark.parametrize("key", sorted(UNENFORCED))
def test_every_unenforced_keyword_is_refused_deep_inside(key: str) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {key: {}}}}}
    err = refused(schema)
    assert repr(key) in err.message and ".properties.a.items" in err.message
    assert err.code == "unsupported_schema_keyword"


def test_names_and_data_are_not_keywords() -> None:
    check_schema({"type": "object", "properties": {"not": {"type": "string"},
                                                   "allOf": {"enum": [{"not": 1}]}},
                  "$defs": {"if": {"const": {"contains": 2}}}}, "x")


def test_an_empty_type_list_is_refused() -> None:
    assert '"type": []' in refused({"anyOf": [{"type": []}]}).message


def test_depth_and_size_are_bounded_without_recursion() -> None:
    node: dict = {"type": "integer"}
    for _ in range(100_000):  # far past Python's recursion limit
        node = {"type": "array", "items": node}
    assert refused(node).code == "schema_too_deep"
    wide = {"type": "object", "properties": {f"p{i}": {} for i in range(50)}}
    assert refused(wide, SchemaLimits(max_nodes=40)).code == "schema_too_large"
    check_schema(wide, "x", SchemaLimits(max_nodes=51))
    deep32 = {"type": "integer"}
    for _ in range(31):
        deep32 = {"type": "array", "items": deep32}
    check_schema(deep32, "x")


def test_a_one_branch_allof_is_that_branch_and_is_checked_inside() -> None:
    check_schema({"type": "object", "properties": {"a": {"allOf": [{"$ref": "#/$defs/X"}],
                                                         "description": "d"}},
                  "$defs": {"X": {"type": "integer"}}}, "x")
    assert "'not'" in refused({"allOf": [{"not": {}}]}).message
    assert "'allOf'" in refused({"allOf": [{"type": "integer"}, {"minimum": 5}]}).message
