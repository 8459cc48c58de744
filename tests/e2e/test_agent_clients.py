"""Agent clients, unchanged, against `bulkhead up` on the default model (SmolLM2-135M-Instruct,
whose chat template has no tool syntax), and again on the same weights with a tool-call template
given by ``--chat-template`` (deploy/chat_templates/chatml_tools.jinja): the official openai
client (tools named / required / auto, ``parse`` with pydantic, ``pydantic_function_tool``),
langchain-openai (``bind_tools``, the three ``with_structured_output`` methods), litellm and
the OpenAI Agents SDK (a function tool's round trip).

String fields carry a ``pattern``: xgrammar's JSON strings admit raw control characters, which a
small model may pick and strict JSON parsers refuse."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from launch.launcher import free_port, redis_server_path
from launch.up import start
from launch.up_options import UpOptions, tool_args
from tests.e2e.conftest import E2E, check_tool_calls
from tests.helpers.default_model import default_model_or_skip

pytestmark = pytest.mark.slow  # two deployments of SmolLM2 on the CPU

TEMPLATE = Path(__file__).resolve().parents[2] / "deploy" / "chat_templates" / "chatml_tools.jinja"
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
         "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "description": "The weather forecast of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time",
                                           "description": "The time in a zone",
                                           "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]


class GetWeather(BaseModel):
    """The weather forecast of a city."""

    city: str = Field(pattern="^[A-Za-z ]{1,12}$")
    days: int = Field(ge=1, le=7)


class Answer(BaseModel):
    """Reasoning first, then the answer: the keys must come in this order."""

    reasoning: str = Field(pattern="^[A-Za-z ,.]{1,40}$")
    answer: int = Field(ge=0, le=100)


@pytest.fixture(scope="module", params=["model-template", "chat-template-file"])
def e2e(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[E2E]:
    if redis_server_path() is None:
        pytest.skip("redis-server is not installed")
    model = default_model_or_skip()
    template = str(TEMPLATE) if request.param == "chat-template-file" else ""
    opts = UpOptions(model=str(model), port=free_port(),
                     log_dir=str(tmp_path_factory.mktemp("logs")), startup_timeout_s=300,
                     extra_worker_args=("--device", "cpu", "--max-context", "2048",
                                        "--chunk-tokens", "256", "--max-batch", "4",
                                        "--kv-staging-gb", "0.1", "--num-threads", "1"),
                     extra_router_args=tool_args(template, ""))
    deployment = start(opts, log=lambda line: None)
    try:
        yield E2E(deployment, Path(model))
    finally:
        deployment.stop()


def has_template(e2e: E2E) -> bool:
    return any("--chat-template" in p.argv for p in e2e.deployment.group.processes)


def check_calls(calls, names=None) -> None:
    check_tool_calls(calls, SCHEMAS, names)


def test_openai_required_and_named(e2e: E2E) -> None:
    client = e2e.client()
    r = client.chat.completions.create(model=e2e.model, messages=ASK, tools=TOOLS,
                                       tool_choice="required", max_tokens=80, temperature=0)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
    check_calls(r.choices[0].message.tool_calls)
    r = client.chat.completions.create(
        model=e2e.model, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    check_calls(r.choices[0].message.tool_calls, ["get_weather"])
    args = json.loads(r.choices[0].message.tool_calls[0].function.arguments)
    assert list(args) == ["city", "days"]  # the schema's order


def test_openai_auto(e2e: E2E) -> None:
    client = e2e.client()
    kw = dict(model=e2e.model, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0)
    if not has_template(e2e):
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(**kw)
        assert exc.value.body["param"] == "tool_choice"
        assert "--tool-call-parser" in exc.value.body["message"]
        return
    choice = client.chat.completions.create(**kw).choices[0]
    if choice.message.tool_calls:  # the model chose to call: a declared, valid call
        check_calls(choice.message.tool_calls)
        assert choice.finish_reason == "tool_calls"
    else:
        assert choice.message.content


def test_openai_parse_with_pydantic_keeps_the_key_order(e2e: E2E) -> None:
    r = e2e.client().chat.completions.parse(
        model=e2e.model, max_tokens=80, temperature=0, response_format=Answer,
        messages=[{"role": "user", "content": "What is 6 times 7? Think, then answer."}])
    msg = r.choices[0].message
    assert isinstance(msg.parsed, Answer)
    assert list(json.loads(msg.content)) == ["reasoning", "answer"]


def test_openai_pydantic_function_tool(e2e: E2E) -> None:
    r = e2e.client().chat.completions.parse(
        model=e2e.model, messages=ASK, max_tokens=80, temperature=0,
        tools=[openai.pydantic_function_tool(GetWeather)], tool_choice="required",
        parallel_tool_calls=False)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "GetWeather"
    assert isinstance(call.function.parsed_arguments, GetWeather)


def _chat_model(e2e: E2E):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=e2e.deployment.url + "/v1", api_key="none", model=e2e.model,
                      temperature=0, max_tokens=80, max_retries=0, timeout=120)


def test_langchain_bind_tools(e2e: E2E) -> None:
    msg = _chat_model(e2e).bind_tools(TOOLS, tool_choice="required").invoke(ASK[0]["content"])
    assert msg.tool_calls
    for call in msg.tool_calls:
        jsonschema.validate(call["args"], SCHEMAS[call["name"]])


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_langchain_with_structured_output(e2e: E2E, method: str) -> None:
    schema = GetWeather if method != "json_mode" else {
        "title": "weather", "description": "A forecast request", **WEATHER}
    out = _chat_model(e2e).with_structured_output(schema, method=method).invoke(
        "Weather in Paris for 3 days? Answer in JSON with city and days.")
    if method == "json_mode":
        assert isinstance(out, dict)  # any JSON object: json_mode does not enforce the schema
    else:
        assert isinstance(out, GetWeather)


def test_litellm_tools(e2e: E2E) -> None:
    litellm = pytest.importorskip("litellm")
    r = litellm.completion(model=f"openai/{e2e.model}", api_base=e2e.deployment.url + "/v1",
                           api_key="none", messages=ASK, tools=TOOLS, tool_choice="required",
                           max_tokens=80, temperature=0)
    calls = r.choices[0].message.tool_calls
    assert calls and calls[0].function.name in SCHEMAS
    jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS[calls[0].function.name])


def test_a_tool_round_trip(e2e: E2E) -> None:
    """An agent's loop: the call, its result fed back as a tool turn, and a final answer."""
    client = e2e.client()
    first = client.chat.completions.create(
        model=e2e.model, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0].message
    check_calls(first.tool_calls, ["get_weather"])
    messages = [*ASK, first.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": first.tool_calls[0].id,
                 "content": json.dumps({"forecast": "sunny", "high_c": 21})}]
    final = client.chat.completions.create(model=e2e.model, messages=messages, tools=TOOLS,
                                           tool_choice="none", max_tokens=40, temperature=0)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


def test_agents_sdk_function_tool_round_trip(e2e: E2E) -> None:
    """The Agents SDK's own loop over chat completions: the model must call the Python function
    tool (forced on the first turn), the SDK runs it and sends its result back, and the model
    answers from it. The SDK then drops the forced choice (``reset_tool_choice``), so the second
    turn is ``auto``: on the model's own template, without a tool-call parser, the run ends in
    the server's 400 naming ``tool_choice`` and the settings that enable it, as any other client
    gets."""
    agents = pytest.importorskip("agents")
    calls: list[tuple[str, int]] = []

    @agents.function_tool
    def get_weather(city: Annotated[str, Field(pattern="^[A-Za-z ]{1,12}$")],
                    days: Annotated[int, Field(ge=1, le=7)]) -> str:
        """The weather forecast of a city.

        Args:
            city: The city.
            days: How many days ahead.
        """
        calls.append((city, days))
        return json.dumps({"city": city, "forecast": "sunny", "high_c": 21})

    client = openai.AsyncOpenAI(base_url=e2e.deployment.url + "/v1", api_key="none",
                                max_retries=0, timeout=120)
    agent = agents.Agent(
        name="forecaster", instructions="Answer with the forecast the tool gives.",
        model=agents.OpenAIChatCompletionsModel(model=e2e.model, openai_client=client),
        tools=[get_weather],
        model_settings=agents.ModelSettings(tool_choice="get_weather", temperature=0,
                                            max_tokens=60, parallel_tool_calls=False))
    run = dict(max_turns=4, run_config=agents.RunConfig(tracing_disabled=True))
    if not has_template(e2e):
        with pytest.raises(openai.BadRequestError) as exc:
            agents.Runner.run_sync(agent, ASK[0]["content"], **run)
        assert exc.value.body["param"] == "tool_choice"
        assert "--tool-call-parser" in exc.value.body["message"]
        assert len(calls) == 1  # the forced call was made and run before the auto turn
        return
    result = agents.Runner.run_sync(agent, ASK[0]["content"], **run)
    assert calls and all(1 <= days <= 7 for _, days in calls)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds
    assert kinds[-1] == "message_output_item", kinds
    assert isinstance(result.final_output, str) and result.final_output.strip()


# vLLM's request fields (template-independent: run once, on the model's own template)

def _vllm(e2e: E2E, **extra):
    if has_template(e2e):
        pytest.skip("template-independent; run on the model's own template")
    return e2e.client().chat.completions.create(
        model=e2e.model, max_tokens=40, temperature=0, extra_body=extra,
        messages=[{"role": "user", "content": "Is Paris in France? Say yes or no."}]).choices[0]


@pytest.mark.parametrize("field", ["guided_choice", "structured_outputs.choice"])
def test_vllm_choice(e2e: E2E, field: str) -> None:
    options = ["yes", "no", "maybe so"]
    extra = ({"guided_choice": options} if field == "guided_choice"
             else {"structured_outputs": {"choice": options}})
    choice = _vllm(e2e, **extra)
    assert choice.message.content in options and choice.finish_reason == "stop"


@pytest.mark.parametrize("field", ["guided_regex", "structured_outputs.regex"])
def test_vllm_regex(e2e: E2E, field: str) -> None:
    pattern = "(yes|no), [a-z]{2,8}\\."
    extra = ({"guided_regex": pattern} if field == "guided_regex"
             else {"structured_outputs": {"regex": pattern}})
    import re

    assert re.fullmatch(pattern, _vllm(e2e, **extra).message.content)


@pytest.mark.parametrize("field", ["guided_grammar", "structured_outputs.grammar"])
def test_vllm_grammar(e2e: E2E, field: str) -> None:
    grammar = 'root ::= answer "!"\nanswer ::= "yes" | "no"'
    extra = ({"guided_grammar": grammar} if field == "guided_grammar"
             else {"structured_outputs": {"grammar": grammar}})
    assert _vllm(e2e, **extra).message.content in ("yes!", "no!")


def test_vllm_lark_grammar_is_a_400_naming_it(e2e: E2E) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        _vllm(e2e, guided_grammar='start: "yes" | "no"')
    assert exc.value.body["param"] == "guided_grammar" and "Lark" in exc.value.body["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        _vllm(e2e, structured_outputs={"grammar": "root ::= undefined"})
    assert exc.value.body["param"] == "structured_outputs.grammar"
    assert "structured_outputs.grammar: cannot build a grammar" in exc.value.body["message"]


@pytest.mark.parametrize("field", ["guided_json", "structured_outputs.json"])
def test_vllm_json_keeps_the_key_order(e2e: E2E, field: str) -> None:
    schema = Answer.model_json_schema()
    extra = ({"guided_json": schema} if field == "guided_json"
             else {"structured_outputs": {"json": schema}})
    out = json.loads(_vllm(e2e, **extra).message.content)
    assert list(out) == ["reasoning", "answer"]
    Answer.model_validate(out)


def test_vllm_detokenization_fields(e2e: E2E) -> None:
    plain = _vllm(e2e, max_tokens=200)
    assert plain.finish_reason == "stop"
    kept = _vllm(e2e, max_tokens=200, skip_special_tokens=False, include_stop_str_in_output=True)
    assert kept.message.content == plain.message.content + "<|im_end|>"
    text = plain.message.content
    assert len(text) >= 2
    stop = text[len(text) // 2]  # cut where it first appears, kept or not
    cut = _vllm(e2e, max_tokens=200, stop=[stop])
    with_stop = _vllm(e2e, max_tokens=200, stop=[stop], include_stop_str_in_output=True)
    assert cut.message.content == text[:text.index(stop)]
    assert with_stop.message.content == cut.message.content + stop
