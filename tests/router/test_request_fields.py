"""No silently ignored field: every field the request models declare is in docs/request_fields.md
as honoured, refused or not applicable, and the table is checked against the running router.

An honoured field must change something: the requests the (fake) workers receive or the answer
the client gets, compared with the same request without it. A refused field set to a value that
asks for something must be a 400 naming it. The router loads its tokenizer and chat template
from a model folder (the production path), with a template that reads tools and a template
variable, and the fake workers' scripted output holds special tokens side by side."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.json_format import MessageToDict

from router.schemas import ChatCompletionRequest, CompletionRequest
from tests.router.conftest import MODEL, Cluster, start_cluster
from tests.router.router_fakes import LoopThread, TinyTokenizer

DOC = Path(__file__).resolve().parents[2] / "docs" / "request_fields.md"
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}{% if tools %}tools: {{ tools | length }}\n{% endif %}"
            "{% if flavour %}{{ flavour }}\n{% endif %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
OUTPUT = " The answer<|im_end|><|im_start|> is 42. END"
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}]
USER = {"role": "user", "content": "Hi"}
BASES = {"chat/completions": {"model": MODEL, "messages": [USER], "max_tokens": 40},
         "completions": {"model": MODEL, "prompt": "Hi", "max_tokens": 40}}
C, T = "chat/completions", "completions"

# field -> {endpoint: (what the base request adds, what the probe adds on top)}
BOTH: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "model": ({}, {"model": "other"}),
    "max_tokens": ({}, {"max_tokens": 3}),
    "temperature": ({}, {"temperature": 0.5}),
    "top_p": ({}, {"top_p": 0.5}),
    "top_k": ({}, {"top_k": 5}),
    "min_p": ({}, {"min_p": 0.1}),
    "seed": ({}, {"seed": 7}),
    "n": ({}, {"n": 2}),
    "stream": ({}, {"stream": True}),
    "stream_options": ({"stream": True}, {"stream_options": {"include_usage": True}}),
    "stop": ({}, {"stop": ["42"]}),
    "stop_token_ids": ({}, {"stop_token_ids": [5]}),
    "ignore_eos": ({}, {"ignore_eos": True}),
    "return_token_ids": ({}, {"return_token_ids": True}),
    "presence_penalty": ({}, {"presence_penalty": 0.5}),
    "frequency_penalty": ({}, {"frequency_penalty": 0.5}),
    "repetition_penalty": ({}, {"repetition_penalty": 1.2}),
    "logit_bias": ({}, {"logit_bias": {"5": 1.0}}),
    "min_tokens": ({}, {"min_tokens": 2}),
    "num_speculative_tokens": ({}, {"num_speculative_tokens": 2}),
    "skip_special_tokens": ({}, {"skip_special_tokens": False}),
    "spaces_between_special_tokens": ({"skip_special_tokens": False},
                                      {"spaces_between_special_tokens": False}),
    "include_stop_str_in_output": ({"stop": ["42"]}, {"include_stop_str_in_output": True}),
    "response_format": ({}, {"response_format": {"type": "json_object"}}),
    "structured_outputs": ({}, {"structured_outputs": {"regex": "[a-z]+"}}),
    "guided_json": ({}, {"guided_json": {"type": "object"}}),
    "guided_regex": ({}, {"guided_regex": "[a-z]+"}),
    "guided_choice": ({}, {"guided_choice": ["yes", "no"]}),
    "guided_grammar": ({}, {"guided_grammar": 'root ::= "a"'}),
}
PROBES: dict[str, dict[str, tuple[dict[str, Any], dict[str, Any]]]] = {
    **{name: {C: probe, T: probe} for name, probe in BOTH.items()},
    "logprobs": {C: ({}, {"logprobs": True}), T: ({}, {"logprobs": 2})},
    "messages": {C: ({}, {"messages": [{"role": "user", "content": "Bye"}]})},
    "max_completion_tokens": {C: ({}, {"max_completion_tokens": 3})},
    "top_logprobs": {C: ({"logprobs": True}, {"top_logprobs": 3})},
    "add_generation_prompt": {C: ({}, {"add_generation_prompt": False})},
    "continue_final_message": {C: (
        {"messages": [USER, {"role": "assistant", "content": "The answer"}],
         "add_generation_prompt": False}, {"continue_final_message": True})},
    "chat_template_kwargs": {C: ({}, {"chat_template_kwargs": {"flavour": "terse"}})},
    "tools": {C: ({"tool_choice": "none"}, {"tools": TOOLS})},
    "tool_choice": {C: ({"tools": TOOLS, "tool_choice": "none"},
                        {"tool_choice": {"type": "function", "function": {"name": "get_time"}}})},
    "parallel_tool_calls": {C: ({"tools": TOOLS, "tool_choice": "required"},
                                {"parallel_tool_calls": False})},
    "prompt": {T: ({}, {"prompt": "Bye"})},
    "echo": {T: ({}, {"echo": True})},
}
REFUSED_VALUES = {"best_of": 3, "modalities": ["audio"]}   # others: true


def documented() -> dict[str, tuple[set[str], str]]:
    """field -> (endpoints, status) from the table in docs/request_fields.md."""
    out = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            ends = {C if e == "C" else T for e in cells[1].split()}
            out[cells[0].strip("`")] = (ends, cells[2])
    return out


def declared() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for endpoint, model in ((C, ChatCompletionRequest), (T, CompletionRequest)):
        for name in model.model_fields:
            out.setdefault(name, set()).add(endpoint)
    return out


def test_every_declared_field_is_in_the_table() -> None:
    doc = documented()
    assert {k: v[0] for k, v in doc.items()} == declared()
    assert {v[1] for v in doc.values()} <= {"honoured", "refused", "not applicable"}
    honoured = {(f, e) for f, (ends, status) in doc.items() if status == "honoured"
                for e in ends}
    assert honoured == {(f, e) for f, probes in PROBES.items() for e in probes}


@pytest.fixture(scope="module")
def cluster(loop_thread: LoopThread, tok: TinyTokenizer,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    folder = tmp_path_factory.mktemp("model")
    tok.save_hf_folder(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config,
                                                              "chat_template": TEMPLATE}))
    c = start_cluster(loop_thread, tok, model_path=str(folder))
    script = tok.encode(OUTPUT, add_special_tokens=False)
    for w in c.prefill + c.decode:
        w.script = script
    yield c
    c.close()


_IDS = re.compile(r"(chatcmpl|cmpl)-[0-9a-f]{32}")


def observe(c: Cluster, endpoint: str, body: dict[str, Any]) -> tuple[int, str, str]:
    """(status, the answer, what the workers were sent), without ids and times."""
    for w in c.prefill + c.decode:
        w.prefills.clear()
        w.generates.clear()
    with c.http() as h:
        r = h.post(f"/v1/{endpoint}", json=body)
    answer = re.sub(r'"created":\d+', '"created":0', _IDS.sub("ID", r.text))
    sent = []
    for m in [*(p for w in c.prefill for p in w.prefills),
              *(g for w in c.decode for g in w.generates)]:
        d = MessageToDict(m)
        d.pop("requestId", None)
        d.pop("deadlineUnixS", None)
        sent.append(d)
    return r.status_code, answer, json.dumps(sent, sort_keys=True)


@pytest.mark.parametrize(("field", "endpoint"),
                         [(f, e) for f, probes in PROBES.items() for e in probes])
def test_an_honoured_field_changes_something(cluster: Cluster, field: str,
                                             endpoint: str) -> None:
    base, probe = PROBES[field][endpoint]
    body = {**BASES[endpoint], **base}
    before = observe(cluster, endpoint, body)
    assert before[0] == 200, before[1]
    after = observe(cluster, endpoint, {**body, **probe})
    assert after != before, f"{field} changed nothing on {endpoint}"


@pytest.mark.parametrize(("field", "endpoint"),
                         [(f, e) for f, (ends, status) in documented().items()
                          if status == "refused" for e in sorted(ends)])
def test_a_refused_field_is_a_400_naming_it(cluster: Cluster, field: str, endpoint: str) -> None:
    status, answer, sent = observe(cluster, endpoint, {**BASES[endpoint],
                                                       field: REFUSED_VALUES.get(field, True)})
    assert status == 400 and json.loads(answer)["error"]["param"] == field, answer
    assert sent == "[]"
