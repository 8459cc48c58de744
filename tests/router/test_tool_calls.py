"""Tool-call syntaxes: text written under the very grammar the workers compile (xgrammar's
structural tag for each model family, walked with a character vocabulary) parses back into the
declared calls; streamed in pieces it gives exactly the same calls; bad tools are refused naming
the field."""

from __future__ import annotations

import json

import jsonschema
import pytest

from router.errors import ApiError
from router.tool_calls import (
    TRIGGERS,
    ToolCallStream,
    detect_format,
    parse_tool_calls,
    plan_tools,
)
from tests.helpers.grammar_walk import char_compiler
from tests.helpers.grammar_walk import walk as grammar_walk

xgr = pytest.importorskip("xgrammar")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1,
                                                     "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
         "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
TEMPLATES = {
    "qwen_3": "{% for m in messages %}{{ m.content }}{% endfor %}<tool_call>{{ tools }}",
    "llama": "<|start_header_id|>{% if tools %}{{ tools }}{% endif %}<|eot_id|>",
    "deepseek_v4": "{{ messages }}<｜DSML｜tool_calls>",
}
@pytest.fixture(scope="module")
def compiler():
    return char_compiler()


def walk(compiler, spec: str, seed: int, prefix: str = "") -> str:
    """A text the tool-call grammar of ``spec`` accepts (a random walk, closers favoured)."""
    req = json.loads(spec)
    tag = xgr.get_model_structural_tag(req["format"], tools=req["tools"],
                                       tool_choice=req["tool_choice"], reasoning="disabled",
                                       parallel_tool_calls=req["parallel_tool_calls"])
    return grammar_walk(compiler.compile_structural_tag(tag), seed, prefix)


def check_calls(calls, names=None) -> None:
    assert calls
    for c in calls:
        assert c.name in (names or SCHEMAS)
        jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])


@pytest.mark.parametrize("fmt", ["qwen_3", "llama", "deepseek_v4"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_calls_parse(compiler, fmt: str, seed: int) -> None:
    plan = plan_tools(TOOLS, "required", True, TEMPLATES[fmt])
    assert plan is not None and plan.format == fmt
    text = walk(compiler, plan.grammar_spec, seed)
    parsed = parse_tool_calls(fmt, text)
    check_calls(parsed.calls)
    assert parsed.content is None


@pytest.mark.parametrize("fmt", ["qwen_3", "llama", "deepseek_v4"])
def test_named_choice_calls_that_function(compiler, fmt: str) -> None:
    plan = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}}, False,
                      TEMPLATES[fmt])
    parsed = parse_tool_calls(fmt, walk(compiler, plan.grammar_spec, 7))
    check_calls(parsed.calls, ["get_time"])
    assert len(parsed.calls) == 1  # parallel_tool_calls false: one call


@pytest.mark.parametrize("fmt", ["qwen_3", "deepseek_v4"])
@pytest.mark.parametrize("pieces", [1, 3, 7])
def test_stream_reassembles_the_same_calls(compiler, fmt: str, pieces: int) -> None:
    plan = plan_tools(TOOLS, "auto", True, TEMPLATES[fmt])
    # under "auto" the model chooses to call: the walk starts after the trigger
    text = walk(compiler, plan.grammar_spec, pieces, prefix="Let me look. " + TRIGGERS[fmt])
    whole = parse_tool_calls(fmt, text)
    check_calls(whole.calls)
    assert whole.content == "Let me look. "
    stream = ToolCallStream(fmt)
    content = ""
    for i in range(0, len(text), pieces):
        content += stream.add(text[i:i + pieces])
    rest, _, parsed = stream.finish()
    assert content + rest == "Let me look. " and parsed == whole


def test_plain_text_streams_through() -> None:
    stream = ToolCallStream("qwen_3")
    text = "  no <tool but <b>text</b> here <tool_"
    got = "".join(stream.add(text[i:i + 2]) for i in range(0, len(text), 2))
    rest, _, parsed = stream.finish()
    assert got + rest == text and not parsed.calls and parsed.content == text


def test_detect_format() -> None:
    for fmt, src in TEMPLATES.items():
        assert detect_format(src) == fmt
    assert detect_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert detect_format(None) is None


@pytest.mark.parametrize("tools,choice,param", [
    ([{"type": "code_interpreter"}], "auto", "tools[0]"),
    ([{"type": "function", "function": {"name": "bad name"}}], "auto", "tools[0].function.name"),
    (TOOLS + TOOLS[:1], "auto", "tools"),
    (TOOLS, "sometimes", "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    (None, "required", "tool_choice"),
])
def test_bad_tools_name_the_field(tools, choice, param) -> None:
    with pytest.raises(ApiError) as exc:
        plan_tools(tools, choice, None, TEMPLATES["qwen_3"])
    assert exc.value.param == param


def test_auto_without_a_parser_is_a_400_naming_the_settings() -> None:
    with pytest.raises(ApiError) as exc:
        plan_tools(TOOLS, "auto", None, "{{ messages }}")
    assert exc.value.param == "tool_choice"
    assert "--tool-call-parser" in exc.value.message and "--chat-template" in exc.value.message
    assert plan_tools(TOOLS, "none", None, "{{ messages }}").format is None
    # a parser setting names the syntax a template does not teach
    plan = plan_tools(TOOLS, "auto", None, "{{ messages }}", "llama3_json")
    assert plan.format == "llama" and plan.default_prompt


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
@pytest.mark.parametrize("seed", [0, 1])
def test_named_and_required_work_on_any_template(compiler, choice, seed: int) -> None:
    """No tool syntax in the template, no parser: the calls are Hermes calls, enforced by the
    grammar, and the tools reach the prompt in the default form."""
    plan = plan_tools(TOOLS, choice, False, "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert plan.format == "qwen_3" and plan.default_prompt
    parsed = parse_tool_calls(plan.format, walk(compiler, plan.grammar_spec, seed))
    check_calls(parsed.calls, None if choice == "required" else ["get_weather"])
    assert len(parsed.calls) == 1


def test_default_tool_prompt_joins_the_system_turn() -> None:
    from router.chat_prompt import with_default_tools

    history = [{"role": "system", "content": "Be brief."},
               {"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    out = with_default_tools(history, "qwen_3", TOOLS)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools") and '"get_time"' in out[0]["content"]
    assert out[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": '
                                 '{"city": "Oslo", "days": 1}}\n</tool_call>')
    assert out[3]["content"] == "<tool_response>\nsunny\n</tool_response>"
    # what the default prompt teaches is what the parser reads
    assert parse_tool_calls("qwen_3", out[2]["content"]).calls[0].name == "get_weather"


@pytest.mark.parametrize("fmt", ["qwen_3", "llama", "deepseek_v4"])
def test_the_default_prompt_teaches_the_syntax_the_parser_reads(fmt: str) -> None:
    from router.tool_calls import default_tool_prompt

    prompt = default_tool_prompt(fmt, TOOLS)
    assert '"get_weather"' in prompt and '"get_time"' in prompt
    assert {"qwen_3": "<tool_call>", "llama": '"parameters"',
            "deepseek_v4": "<｜DSML｜invoke"}[fmt] in prompt
