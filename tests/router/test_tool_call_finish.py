"""Stream = non-stream for tool calls in every finish state: the router in front of fake workers
whose scripted output is two Hermes calls, cut by max_tokens at every token. The rule (docs/serving.md,
router/tool_calls.py): the calls are those whose beginning was written; a cut call keeps the
arguments written so far and the finish_reason is ``length``; output with no call is content."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.router.conftest import MODEL, Cluster, start_cluster
from tests.router.router_fakes import LoopThread, TinyTokenizer

OUTPUT = ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}]


@pytest.fixture(scope="module")
def cluster(loop_thread: LoopThread, tok: TinyTokenizer) -> Iterator[Cluster]:
    # the default tool prompt is long in a 400-token vocabulary
    c = start_cluster(loop_thread, tok, worker_kw={"max_context": 4096})
    for w in c.prefill + c.decode:
        w.script = tok.encode(OUTPUT, add_special_tokens=False)
    yield c
    c.close()


def _streamed(c: Cluster, body: dict) -> tuple[str | None, list[dict], str]:
    content, calls, finish = "", {}, None
    for chunk in c.client().chat.completions.create(stream=True, **body):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                slot = calls.setdefault(d.index, {"name": "", "arguments": ""})
                slot["name"] += d.function.name or ""
                slot["arguments"] += d.function.arguments or ""
    return content or None, [calls[i] for i in sorted(calls)], finish


def test_stream_and_non_stream_agree_at_every_cut(cluster: Cluster, tok: TinyTokenizer) -> None:
    num_tokens = len(tok.encode(OUTPUT, add_special_tokens=False))
    seen = set()
    for max_tokens in range(1, num_tokens + 2):
        body = dict(model=MODEL, messages=[{"role": "user", "content": "Time?"}], tools=TOOLS,
                    tool_choice="required", max_tokens=max_tokens)
        whole = cluster.client().chat.completions.create(**body).choices[0]
        calls = [{"name": c.function.name, "arguments": c.function.arguments}
                 for c in whole.message.tool_calls or []]
        assert _streamed(cluster, body) == (whole.message.content, calls,
                                            whole.finish_reason), max_tokens
        cut = max_tokens <= num_tokens
        assert whole.finish_reason == ("length" if cut else "tool_calls")
        if calls:  # text after a call began is never content
            assert whole.message.content is None
        seen.add((len(calls), all(_is_json(c["arguments"]) for c in calls)))
    # the cuts covered: no call yet, one call cut, one whole and one cut, two whole
    assert {(0, True), (1, False), (2, False), (2, True)} <= seen


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True
