"""Requests that took a worker down in issue 39's attack run, each beside plain streams, through
router + prefill + decode processes with the official openai client: the offending request gets a
clear answer (a 400 naming what went wrong, or a defined finish), the plain streams finish, and
no worker process dies or restarts."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import openai
import pytest

from tests.e2e.conftest import E2E, SPLIT_THRESHOLD, deploy
from tests.e2e.test_tools_and_structured import ASK, TOOLS
from tests.helpers.beside_streams import beside_plain_streams as beside
from tests.helpers.tiny_tool_model import write_tiny_tool_llama

HI = [{"role": "user", "content": "hi"}]
LONG = [{"role": "user", "content": " ".join(["word"] * (SPLIT_THRESHOLD + 20))}]


@pytest.fixture(scope="module")
def e2e(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2E]:
    yield from deploy(tmp_path_factory, "--max-context", "4096", "--chunk-tokens", "256",
                      write_model=write_tiny_tool_llama)


def schema(s: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": s}}


def beside_plain_streams(e2e: E2E, bad: Callable[[], object], num_streams: int = 3) -> object:
    """Run ``bad`` while ``num_streams`` plain chats stream; -> what ``bad`` returned or raised.
    Asserts that every plain stream finished and that no process died."""
    pids = [p.pid for p in e2e.deployment.group.processes]
    result = beside(bad, lambda _: e2e.client().chat.completions.create(
        model=e2e.model, messages=HI, max_tokens=48, temperature=0.0, stream=True,
        extra_body={"ignore_eos": True}), num_streams)
    assert [p.pid for p in e2e.deployment.group.processes] == pids
    assert all(p.alive() for p in e2e.deployment.group.processes)
    return result


def chat(e2e: E2E, messages=HI, **kw):
    return e2e.client().chat.completions.create(model=e2e.model, messages=messages, **kw)


@pytest.mark.parametrize("temperature", [1e-45, 1e-37, 5e-6])
def test_a_tiny_temperature_is_greedy(e2e: E2E, temperature: float) -> None:
    got = beside_plain_streams(e2e, lambda: chat(e2e, max_tokens=16, temperature=temperature))
    greedy = chat(e2e, max_tokens=16, temperature=0.0)
    assert got.choices[0].message.content == greedy.choices[0].message.content


@pytest.mark.parametrize("messages", [HI, LONG], ids=["decode", "split"])
def test_min_tokens_past_a_boolean_schema_is_a_clear_error(e2e: E2E, messages) -> None:
    got = beside_plain_streams(e2e, lambda: chat(
        e2e, messages, max_tokens=16, temperature=0.7, response_format=schema(
            {"type": "boolean"}), extra_body={"min_tokens": 8}))
    assert isinstance(got, openai.BadRequestError), got
    assert "no token is allowed next" in got.message


def test_a_schema_that_admits_nothing_is_a_clear_error(e2e: E2E) -> None:
    got = beside_plain_streams(e2e, lambda: chat(
        e2e, max_tokens=16, temperature=1.0, response_format=schema({"$ref": "#"})))
    assert isinstance(got, openai.BadRequestError), got
    assert "cannot continue" in got.message


def test_a_stream_ended_mid_way_gets_an_error_event(e2e: E2E) -> None:
    def bad() -> object:
        stream = chat(e2e, max_tokens=16, temperature=0.7, stream=True,
                      response_format=schema({"type": "boolean"}),
                      extra_body={"min_tokens": 8})
        for _ in stream:
            pass
        return None

    got = beside_plain_streams(e2e, bad)
    assert isinstance(got, openai.APIError) and "no token is allowed next" in str(got), got


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_ignore_eos_with_a_schema_ends_when_the_grammar_does(e2e: E2E, temperature) -> None:
    got = beside_plain_streams(e2e, lambda: chat(
        e2e, max_tokens=32, temperature=temperature, seed=1,
        response_format=schema({"enum": ["yes", "no"]}), extra_body={"ignore_eos": True}))
    assert got.choices[0].finish_reason == "stop"
    assert got.choices[0].message.content in ('"yes"', '"no"')


def test_ignore_eos_with_required_tools_ends_after_the_call(e2e: E2E) -> None:
    got = beside_plain_streams(e2e, lambda: chat(
        e2e, ASK, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0.0,
        parallel_tool_calls=False, extra_body={"ignore_eos": True}))
    assert got.choices[0].finish_reason == "tool_calls"
    assert len(got.choices[0].message.tool_calls) == 1
