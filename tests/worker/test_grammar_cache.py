"""What the workers' grammars allow, walked with a character vocabulary (no model): JSON keys
come in the schema's property order, nested objects and tool arguments included."""

from __future__ import annotations

import json
import re

import pytest

from router.structured_outputs import response_format_grammar
from router.tool_calls import parse_tool_calls, plan_tools
from tests.helpers.grammar_walk import accepts, char_compiler, walk
from worker.grammar_cache import _compile

pytest.importorskip("xgrammar")

# deliberately not alphabetical, at every level
INNER = {"type": "object", "properties": {"zeta": {"type": "integer", "minimum": 0,
                                                   "maximum": 9},
                                          "alpha": {"type": "string", "maxLength": 4}},
         "required": ["zeta", "alpha"], "additionalProperties": False}
ORDERED = {"type": "object",
           "properties": {"reasoning": {"type": "string", "maxLength": 6},
                          "answer": INNER,
                          "confidence": {"type": "integer", "minimum": 0, "maximum": 9}},
           "required": ["reasoning", "answer", "confidence"], "additionalProperties": False}
TEMPLATES = {"qwen_3": "<tool_call>{{ tools }}",
             "llama": "<|start_header_id|>{% if tools %}{{ tools }}{% endif %}",
             "deepseek_v4": "<｜DSML｜tool_calls>"}


@pytest.fixture(scope="module")
def compiler():
    return char_compiler()


def _key_orders(value: object) -> list[list[str]]:
    """The key order of every object in ``value``, outermost first."""
    if isinstance(value, dict):
        out = [list(value)]
        for v in value.values():
            out += _key_orders(v)
        return out
    return []


@pytest.mark.parametrize("seed", range(4))
def test_response_format_keeps_the_schema_key_order(compiler, seed: int) -> None:
    g = response_format_grammar({"type": "json_schema",
                                 "json_schema": {"name": "r", "schema": ORDERED}})
    text = walk(_compile(compiler, g.kind, g.spec), seed)
    assert _key_orders(json.loads(text)) == [["reasoning", "answer", "confidence"],
                                             ["zeta", "alpha"]], text


@pytest.mark.parametrize("fmt", ["qwen_3", "llama"])
@pytest.mark.parametrize("seed", range(3))
def test_tool_arguments_keep_the_schema_key_order(compiler, fmt: str, seed: int) -> None:
    tools = [{"type": "function", "function": {"name": "think", "parameters": ORDERED}}]
    plan = plan_tools(tools, "required", False, TEMPLATES[fmt])
    assert plan is not None
    text = walk(_compile(compiler, "tool_calls", plan.grammar_spec), seed)
    calls = parse_tool_calls(fmt, text).calls
    assert len(calls) == 1
    assert _key_orders(json.loads(calls[0].arguments)) == [
        ["reasoning", "answer", "confidence"], ["zeta", "alpha"]], text


def test_regex_choice_and_ebnf_grammars(compiler) -> None:
    regex = _compile(compiler, "regex", "[a-c]{2}-[0-9]")
    assert accepts(regex, "ab-7") and not accepts(regex, "ab-") and not accepts(regex, "abc-1")
    options = ["yes", "no", 'say "hi"\\\n']
    choice = _compile(compiler, "choice", json.dumps(options))
    assert all(accepts(choice, o) for o in options)
    assert not accepts(choice, "ye") and not accepts(choice, "yesno")
    ebnf = _compile(compiler, "grammar", 'root ::= "x" digit+\ndigit ::= [0-9]')
    assert accepts(ebnf, "x12") and not accepts(ebnf, "x") and not accepts(ebnf, "y1")
    assert all(re.fullmatch("[a-c]{2}-[0-9]", walk(regex, s)) for s in range(3))


def test_a_grammar_that_does_not_compile_names_the_field() -> None:
    from engine.errors import InvalidRequest
    from worker.grammar_cache import GrammarCache

    cache = GrammarCache("unused", 10, ())
    cache._compiler = char_compiler()  # no model folder: the character vocabulary
    with pytest.raises(InvalidRequest) as exc:
        cache.compile("grammar", "root ::= undefined_rule")
    assert "structured_outputs: cannot build a grammar" in str(exc.value)
