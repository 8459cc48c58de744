"""Tool calls streamed as they are generated: text written under the workers' own grammars (the
walk of test_tool_calls), fed in pieces, gives each call's name as soon as it is complete and
then argument fragments while the call is still being written; the pieces reassemble exactly
into the non-streamed calls; JSON tokens are re-written as json.dumps writes them."""

from __future__ import annotations

import json

import pytest

from router.openai_format import streamed_tool_calls
from router.tool_call_deltas import IncrementalCalls, JsonCanonicalizer
from router.tool_calls import TRIGGERS, ToolCallStream, parse_tool_calls, plan_tools
from tests.router.test_tool_calls import TEMPLATES, TOOLS, compiler, walk  # noqa: F401

pytest.importorskip("xgrammar")


@pytest.mark.parametrize("raw", [
    '{"a": 1}', '{ "a" :1 , "b":[ 1,2.50 ,-3e2, true,false ,null ] }', '{}', '{"x": {}}',
    '{"s": "tab\\there \\"q\\" \\u00e9 é \\\\ end", "n": {"m": [[], [{}]]}}',
    '{"big": 12345678901234567890, "f": 1E5, "neg": -0.0}', '[1, "a"]',
])
def test_canonical_tokens_are_json_dumps(raw: str) -> None:
    for step in (1, 2, 5, len(raw)):
        c = JsonCanonicalizer()
        out = ""
        for i in range(0, len(raw), step):
            piece, used = c.feed(raw[i:i + step])
            out += piece
        assert c.done
        assert out == json.dumps(json.loads(raw), ensure_ascii=False)


def test_the_value_ends_where_it_closes() -> None:
    c = JsonCanonicalizer()
    out, used = c.feed('{"a": [1]}\n</tool_call>')
    assert out == '{"a": [1]}' and used == len('{"a": [1]}') and c.done


def reassemble(chunks: list[list[dict]]) -> list[dict]:
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for d in chunk:
            slot = calls.setdefault(d["index"], {"id": None, "name": "", "arguments": ""})
            slot["id"] = d.get("id", slot["id"])
            slot["name"] += d["function"].get("name", "")
            slot["arguments"] += d["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("fmt", ["qwen_3", "llama", "deepseek_v4"])
@pytest.mark.parametrize("pieces", [1, 3, 7])
def test_calls_stream_while_written_and_reassemble_exactly(compiler, fmt: str,  # noqa: F811
                                                           pieces: int) -> None:
    plan = plan_tools(TOOLS, "required", True, TEMPLATES[fmt])
    text = walk(compiler, plan.grammar_spec, 10 + pieces)
    assert not text[:text.index(TRIGGERS[fmt])].strip()  # blanks at most before the call
    whole = parse_tool_calls(fmt, text)
    assert whole.calls
    stream = ToolCallStream(fmt)
    chunks: list[list[dict]] = []
    steps_with_calls = []
    for step, i in enumerate(range(0, len(text), pieces)):
        assert stream.add(text[i:i + pieces]) == ""
        deltas = stream.take_deltas()
        if deltas:
            steps_with_calls.append(step)
            chunks.append(streamed_tool_calls(deltas, "chatcmpl-abc", 0))
    rest, rest_calls, parsed = stream.finish()
    assert rest == "" and parsed == whole
    chunks.append(streamed_tool_calls(rest_calls, "chatcmpl-abc", 0))
    assert reassemble(chunks) == [
        {"id": f"call_abc_0_{k}", "name": c.name, "arguments": c.arguments}
        for k, c in enumerate(whole.calls)]
    # incremental: the first call was announced long before the text ended, and its
    # arguments came in more than one piece
    last_step = (len(text) - 1) // pieces
    assert steps_with_calls[0] < last_step
    assert len(steps_with_calls) > 2
    assert all(c.complete for c in stream.calls.calls)


def test_a_call_the_reader_missed_comes_whole_at_the_end() -> None:
    # arguments before name: the incremental reader does not follow this order; the end does
    text = '<tool_call>\n{"arguments": {"zone": "UTC"}, "name": "get_time"}\n</tool_call>'
    stream = ToolCallStream("qwen_3")
    stream.add(text)
    assert stream.take_deltas() == []
    _, rest_calls, _ = stream.finish()
    got = streamed_tool_calls(rest_calls, "chatcmpl-x", 2)
    assert reassemble([got]) == [{"id": "call_x_2_0", "name": "get_time",
                                  "arguments": '{"zone": "UTC"}'}]


def test_text_that_is_no_json_stops_the_stream() -> None:
    calls = IncrementalCalls("qwen_3")
    deltas = calls.feed('<tool_call>\n{"name": "f", "arguments": {"a": tru}')
    assert calls.broken and [d.name for d in deltas] == ["f"]
    assert calls.feed("more") == []
