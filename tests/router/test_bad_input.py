"""Every bad input gets an OpenAI-shaped 4xx naming the field, and the server stays healthy."""

from __future__ import annotations

import json
import random
from typing import Any

import openai
import pytest

from tests.router.conftest import MODEL, Cluster

pytestmark = pytest.mark.timeout(120)   # a hang is a failure, never a stuck CI

OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}


def chat(**kw: Any) -> dict[str, Any]:
    return {**OK_CHAT, **kw}


CASES: list[tuple[str, dict[str, Any] | str, int, str | None, str | None]] = [
    # (endpoint, body, status, param, code)
    ("chat/completions", "{not json", 400, "body", "invalid_json"),
    ("chat/completions", "[1, 2]", 400, "body", "invalid_body"),
    ("chat/completions", {"model": MODEL}, 400, "messages", "invalid_value"),
    ("chat/completions", chat(model=None, messages=None), 400, "messages", "invalid_value"),
    ("chat/completions", chat(messages=[]), 400, "messages", "invalid_value"),
    ("chat/completions", chat(messages=[{"role": "wizard", "content": "x"}]), 400,
     "messages[0].role", "invalid_value"),
    ("chat/completions", chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
     400, "messages[0].content[0].type", "unsupported_content"),
    ("chat/completions", chat(temperature=2.5), 400, "temperature", "invalid_value"),
    ("chat/completions", chat(temperature="hot"), 400, "temperature", "invalid_value"),
    ("chat/completions", chat(top_p=0), 400, "top_p", "invalid_value"),
    ("chat/completions", chat(top_k=-2), 400, "top_k", "invalid_value"),
    ("chat/completions", chat(top_k=2**31), 400, "top_k", "invalid_value"),
    ("chat/completions", chat(stop_token_ids=[2**40]), 400, "stop_token_ids[0]",
     "invalid_value"),
    ("chat/completions", chat(max_tokens=2**40), 400, "messages", "context_length_exceeded"),
    ("chat/completions", chat(seed=2**64), 400, "seed", "invalid_value"),
    ("chat/completions", chat(max_tokens=0), 400, "max_tokens", "invalid_value"),
    ("chat/completions", chat(max_completion_tokens=-5), 400, "max_completion_tokens",
     "invalid_value"),
    ("chat/completions", chat(n=0), 400, "n", "invalid_value"),
    ("chat/completions", chat(n=17), 400, "n", None),
    ("chat/completions", chat(seed=-1), 400, "seed", "invalid_value"),
    ("chat/completions", chat(stop=["a"] * 17), 400, "stop", None),
    ("chat/completions", chat(stop=""), 400, "stop", None),
    ("chat/completions", chat(logprobs=True, top_logprobs=21), 400, "top_logprobs",
     "invalid_value"),
    ("chat/completions", chat(top_logprobs=2), 400, "top_logprobs", None),
    ("chat/completions", chat(logit_bias={"x": 1}), 400, "logit_bias", None),
    ("chat/completions", chat(logit_bias={"5": 101}), 400, "logit_bias", "invalid_value"),
    ("chat/completions", chat(repetition_penalty=0), 400, "repetition_penalty",
     "invalid_value"),
    ("chat/completions", chat(min_p=1.5), 400, "min_p", "invalid_value"),
    ("chat/completions", chat(min_tokens=9, max_tokens=3), 400, "min_tokens", None),
    ("chat/completions", chat(functions=[{"name": "f"}]), 400, "functions",
     "unsupported_parameter"),
    ("chat/completions", chat(use_beam_search=True), 400, "use_beam_search",
     "unsupported_parameter"),
    ("chat/completions", chat(guided_grammar="start: \"a\""), 400, "guided_grammar", None),
    ("chat/completions", chat(guided_regex="a+", guided_choice=["a"]), 400, "guided_choice",
     None),
    ("completions", {"model": "tiny", "prompt": "Hi",
                     "structured_outputs": {"regex": "a", "choice": ["a"]}}, 400,
     "structured_outputs", None),
    ("chat/completions", chat(continue_final_message=True), 400, "continue_final_message",
     None),
    ("chat/completions", chat(chat_template_kwargs={"messages": []}), 400,
     "chat_template_kwargs", None),
    # the fake model's template has no tool-call syntax
    ("chat/completions", chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400,
     "tool_choice", None),   # auto with no tool-call parser: the settings are named
    ("chat/completions", chat(tools=[{"type": "retrieval"}]), 400, "tools[0]", None),
    ("chat/completions", chat(tool_choice="required"), 400, "tool_choice", None),
    ("chat/completions", chat(response_format={"type": "xml"}), 400,
     "response_format.type", None),
    ("chat/completions", chat(response_format={"type": "json_schema", "json_schema": {}}), 400,
     "response_format.json_schema.schema", None),
    ("chat/completions", chat(presence_penalty=2.5), 400, "presence_penalty",
     "invalid_value"),
    ("chat/completions", chat(stream_options={"include_usage": True}), 400, "stream_options",
     None),
    ("chat/completions", chat(max_tokens=10_000), 400, "messages", "context_length_exceeded"),
    ("completions", {"model": MODEL}, 400, "prompt", "invalid_value"),
    ("completions", {"model": MODEL, "prompt": []}, 400, "prompt", None),
    ("completions", {"model": MODEL, "prompt": [5, -1]}, 400, "prompt", None),
    ("completions", {"model": MODEL, "prompt": [5, 10**6]}, 400, "prompt", None),
    ("completions", {"model": MODEL, "prompt": ["a", ""]}, 400, "prompt[1]", None),
    ("completions", {"model": MODEL, "prompt": ["a"] * 20, "n": 4}, 400, "n", None),
    ("completions", {"model": MODEL, "prompt": "hi", "logprobs": 6}, 400, "logprobs",
     "invalid_value"),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens", None),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0, "echo": True}, 400,
     "max_tokens", None),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": -1}, 400, "max_tokens",
     "invalid_value"),
    ("completions", {"model": MODEL, "prompt": "hi", "suffix": "x"}, 400, "suffix",
     "unsupported_parameter"),
    ("completions", {"model": MODEL, "prompt": "hi", "best_of": 3}, 400, "best_of",
     "unsupported_parameter"),
    ("completions", {"model": MODEL, "prompt": [1] * 600}, 400, "prompt",
     "context_length_exceeded"),
    ("completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model", "model_not_found"),
    ("chat/completions", chat(model="other", stream=True), 404, "model", "model_not_found"),
]


@pytest.mark.parametrize(("endpoint", "body", "status", "param", "code"), CASES,
                         ids=[f"{i}-{c[0]}-{c[3]}" for i, c in enumerate(CASES)])
def test_bad_input(cluster: Cluster, endpoint: str, body: dict[str, Any] | str, status: int,
                   param: str | None, code: str | None) -> None:
    with cluster.http() as h:
        if isinstance(body, str):
            r = h.post(f"/v1/{endpoint}", content=body,
                       headers={"content-type": "application/json"})
        else:
            r = h.post(f"/v1/{endpoint}", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    if param and param != "body":
        assert param.split("[")[0].split(".")[0] in err["message"] or \
            err["code"] == "context_length_exceeded"
    assert cluster.healthy()


def test_context_length_message_states_the_limit(cluster: Cluster) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        cluster.client().chat.completions.create(model=MODEL, messages=OK_CHAT["messages"],
                                                 max_tokens=600)
    assert e.value.status_code == 400
    assert e.value.code == "context_length_exceeded"
    assert "512" in e.value.message
    # a prompt that fills the extent exactly still leaves no room: refused before any worker
    before = len(cluster.decode[0].generates)
    with pytest.raises(openai.BadRequestError):
        cluster.client().completions.create(model=MODEL, prompt=[5] * 512, max_tokens=1)
    assert len(cluster.decode[0].generates) == before
    # one below the extent fits
    r = cluster.client().completions.create(model=MODEL, prompt=[5] * 511, max_tokens=1)
    assert r.usage.completion_tokens == 1


def test_unknown_route_and_method(cluster: Cluster) -> None:
    with cluster.http() as h:
        r = h.get("/v1/nothing")
        assert r.status_code == 404 and "error" in r.json()
        r = h.get("/v1/chat/completions")
        assert r.status_code == 405 and "error" in r.json()


def test_model_may_be_omitted(cluster: Cluster) -> None:
    with cluster.http() as h:
        r = h.post("/v1/chat/completions", json={"messages": OK_CHAT["messages"],
                                                 "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == MODEL


def test_server_still_serves_after_bad_inputs(cluster: Cluster) -> None:
    r = cluster.client().chat.completions.create(model=MODEL, messages=OK_CHAT["messages"],
                                                 max_tokens=3)
    assert r.choices[0].finish_reason == "length"


def test_random_mutations_never_give_a_5xx(cluster: Cluster) -> None:
    """Seeded fuzz: valid bodies with one field replaced by a value of another type or range."""
    rng = random.Random(1234)
    values: list[Any] = [None, True, -1, 0, 1, 2**33, -2**70, 1.5, float("inf"), "", "x" * 300,
                         "\u0000\ud7ff", [], [1, "a"], [[1, 2], [3]], {}, {"a": 1}, ["stop"] * 3]
    fields = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens",
              "temperature", "top_p", "top_k", "seed", "n", "stream", "stream_options", "stop",
              "stop_token_ids", "ignore_eos", "return_token_ids", "logprobs", "user", "echo"]
    bases = [("chat/completions", {**OK_CHAT, "max_tokens": 3}),
             ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3})]
    with cluster.http() as h:
        for _ in range(100):
            endpoint, base = rng.choice(bases)
            body = dict(base)
            for _ in range(rng.randint(1, 3)):
                body[rng.choice(fields)] = rng.choice(values)
            try:
                payload = json.dumps(body, allow_nan=True)
            except ValueError:
                continue
            r = h.post(f"/v1/{endpoint}", content=payload,
                       headers={"content-type": "application/json"})
            assert r.status_code < 500, (body, r.text)
            if r.status_code != 200:
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert cluster.healthy()
