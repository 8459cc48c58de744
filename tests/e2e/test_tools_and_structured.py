"""Tool calling and structured outputs end to end: router + prefill + decode processes on a tiny
random Llama whose chat template speaks the Hermes ``<tool_call>`` syntax, the official openai
client. Random weights, so the calls are made deterministic by constrained decoding (tool_choice
required / named, response_format; one call per answer, since a random model never chooses to
stop calling): what is checked is that the server enforces, parses, streams and feeds back
exactly."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from tests.e2e.conftest import E2E, check_tool_calls, deploy
from tests.helpers.tiny_tool_model import write_tiny_tool_llama

# (a pattern on the string: xgrammar's JSON strings admit raw control characters, which a random
# model picks and strict JSON parsers refuse; see the report)
WEATHER = {"type": "object", "properties": {"city": {"type": "string",
                                                     "pattern": "^[A-Za-z ]{1,10}$"},
                                            "days": {"type": "integer", "minimum": 1,
                                                     "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
         "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Clock",
                                           "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
ASK = [{"role": "system", "content": "You help."},
       {"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def e2e(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2E]:
    # tools render long with a 320-token BPE: a longer context than the default deployment
    yield from deploy(tmp_path_factory, "--max-context", "4096", "--chunk-tokens", "256",
                      write_model=write_tiny_tool_llama)


def valid_calls(calls, names=None) -> None:
    check_tool_calls(calls, SCHEMAS, names)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_gives_declared_tool_calls(e2e: E2E, temperature: float) -> None:
    r = e2e.client().chat.completions.create(
        model=e2e.model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120,
        temperature=temperature, seed=3, parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    valid_calls(choice.message.tool_calls)


def test_named_function_and_one_call(e2e: E2E) -> None:
    r = e2e.client().chat.completions.create(
        model=e2e.model, messages=ASK, tools=TOOLS, max_tokens=120, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls
    valid_calls(calls, ["get_time"])
    assert len(calls) == 1


def test_streamed_deltas_reassemble_the_non_streamed_calls(e2e: E2E) -> None:
    kw = dict(model=e2e.model, messages=ASK, tools=TOOLS, tool_choice="required",
              max_tokens=120, temperature=0, parallel_tool_calls=False)
    client = e2e.client()
    whole = client.chat.completions.create(**kw).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    content = ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                if d.index not in calls:  # a call's first delta: its id, type and name
                    assert d.id and d.type == "function" and d.function.name
                slot = calls.setdefault(d.index, {"name": "", "arguments": "", "pieces": 0})
                slot["name"] += d.function.name or ""
                slot["arguments"] += d.function.arguments or ""
                slot["pieces"] += bool(d.function.arguments)
    assert finish == whole.finish_reason == "tool_calls"
    assert [calls[i] for i in sorted(calls)] == [
        {"name": c.function.name, "arguments": c.function.arguments,
         "pieces": calls[i]["pieces"]} for i, c in enumerate(whole.message.tool_calls)]
    # the arguments streamed as they were generated, not in one piece at the end
    assert all(c["pieces"] > 1 for c in calls.values())
    assert content == (whole.message.content or "")


def test_tool_choice_none_and_unknown_tool(e2e: E2E) -> None:
    client = e2e.client()
    r = client.chat.completions.create(model=e2e.model, messages=ASK, tools=TOOLS,
                                       tool_choice="none", max_tokens=8, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason != "tool_calls"
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model=e2e.model, messages=ASK, tools=TOOLS, max_tokens=8,
            tool_choice={"type": "function", "function": {"name": "launch"}})
    assert exc.value.body["param"] == "tool_choice"


def test_three_turn_agent_loop_reuses_the_prefix(e2e: E2E) -> None:
    client = e2e.client()
    messages = list(ASK)
    cached = []
    for turn in range(3):
        r = client.chat.completions.create(model=e2e.model, messages=messages, tools=TOOLS,
                                           tool_choice="required", max_tokens=120,
                                           temperature=0, parallel_tool_calls=False)
        msg = r.choices[0].message
        valid_calls(msg.tool_calls)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        messages.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": json.dumps({"turn": turn, "ok": True})})
    # turn N+1's prompt starts with turn N's: its KV is reused
    assert cached[1] > 0 and cached[2] > cached[1]
    # the history reaches the template: the last prompt holds the earlier calls and results
    r = client.chat.completions.create(model=e2e.model, messages=messages, max_tokens=1,
                                       temperature=0, extra_body={"return_token_ids": True})
    from common.tokenizer import Tokenizer

    text = Tokenizer.from_path(e2e.folder).decode(r.prompt_token_ids, skip_special_tokens=False)
    assert text.count("<tool_call>") == 3 and text.count("<tool_response>") == 3


def test_json_schema_response(e2e: E2E) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER,
                                                  "strict": True}}
    for temperature in (0.0, 1.0):
        r = e2e.client().chat.completions.create(model=e2e.model, messages=ASK, max_tokens=80,
                                                 temperature=temperature, seed=1,
                                                 response_format=fmt)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), WEATHER)


def test_json_object_response(e2e: E2E) -> None:
    r = e2e.client().chat.completions.create(model=e2e.model, messages=ASK, max_tokens=100,
                                             temperature=0,
                                             response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content, strict=False), dict)


@pytest.mark.parametrize("schema", [{"type": 5}, {"type": "frob"}])
def test_bad_schema_is_a_400_naming_the_field(e2e: E2E, schema: dict) -> None:
    """The grammar library's complaint reaches the client on one line, without the C++ log
    prefix (time, source file) it carries, and the error names the field."""
    with pytest.raises(openai.BadRequestError) as exc:
        e2e.client().chat.completions.create(
            model=e2e.model, messages=ASK, max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                                    "schema": schema}})
    assert exc.value.body["param"] == "response_format"
    message = exc.value.body["message"]
    assert "\n" not in message and ".cc:" not in message, message
    assert "response_format: cannot build a grammar" in message


def _chat_model(e2e: E2E):
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(base_url=e2e.deployment.url + "/v1", api_key="none",
                                       model=e2e.model, temperature=0, max_tokens=120,
                                       max_retries=0, timeout=60)


def test_langchain_bind_tools(e2e: E2E) -> None:
    llm = _chat_model(e2e).bind_tools(TOOLS, tool_choice="required", parallel_tool_calls=False)
    msg = llm.invoke("What is the weather in Paris?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] in SCHEMAS
    call = msg.tool_calls[0]
    jsonschema.validate(call["args"], SCHEMAS[call["name"]])


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(e2e: E2E, method: str) -> None:
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        """A forecast request."""

        city: str = Field(pattern="^[A-Za-z ]{1,10}$")
        days: int = Field(ge=1, le=7)

    out = _chat_model(e2e).with_structured_output(Weather, method=method).invoke(
        "Weather in Paris for 3 days?")
    assert isinstance(out, Weather) and 1 <= out.days <= 7
