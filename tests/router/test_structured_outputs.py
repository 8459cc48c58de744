"""Where a request's grammar comes from (router/structured_outputs.py): each of vLLM's fields
and OpenAI's response_format gives the (kind, spec) the workers compile, key order kept; two
sources, an empty choice or a Lark grammar are 400s naming the field; and a worker's complaint
about the grammar names the field the request used."""

from __future__ import annotations

import json

import grpc
import pytest

from router.errors import ApiError, WorkerCallError, from_worker_error
from router.job import GenerationJob
from router.schemas import ChatCompletionRequest
from router.serving import named_for_request
from router.structured_outputs import output_grammar

SCHEMA = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}


def grammar(**fields):
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                **fields})
    return output_grammar(req, req.response_format)


@pytest.mark.parametrize(("fields", "kind", "param"), [
    ({"guided_json": SCHEMA}, "json_schema", "guided_json"),
    ({"guided_json": json.dumps(SCHEMA)}, "json_schema", "guided_json"),
    ({"structured_outputs": {"json": SCHEMA}}, "json_schema", "structured_outputs.json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}},
     "json_schema", "response_format"),
])
def test_json_sources_keep_the_key_order(fields, kind: str, param: str) -> None:
    g = grammar(**fields)
    assert (g.kind, g.param) == (kind, param)
    assert list(json.loads(g.spec)["properties"]) == ["b", "a"]


def test_regex_choice_grammar_and_json_object() -> None:
    assert grammar(guided_regex="a+").spec == "a+"
    assert json.loads(grammar(guided_choice=["x", "y"]).spec) == ["x", "y"]
    assert grammar(structured_outputs={"choice": ["x"]}).kind == "choice"
    assert grammar(structured_outputs={"grammar": 'root ::= "a"'}).kind == "grammar"
    assert grammar(structured_outputs={"json_object": True}).kind == "json_object"
    assert grammar(structured_outputs={"regex": "[0-9]+"}).param == "structured_outputs.regex"
    assert grammar().kind == ""


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"guided_grammar": 'start: "a" | "b"'}, "guided_grammar", "Lark"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one grammar"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "not together with response_format"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least one"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern",
     "not supported"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
])
def test_bad_sources_name_the_field(fields, param: str, words: str) -> None:
    with pytest.raises(ApiError) as exc:
        grammar(**fields)
    assert exc.value.param == param and words in exc.value.message, exc.value


def test_a_workers_grammar_error_names_the_field_the_request_used() -> None:
    job = GenerationJob(kind="chat", model="m", prompts=((1,),), max_tokens=4, temperature=1.0,
                        top_p=1.0, top_k=0, seed=None, n=1, stop=(), stop_token_ids=(),
                        ignore_eos=False, stream=False, include_usage=False,
                        return_token_ids=False, grammar_kind="json_schema", grammar_spec="{}",
                        grammar_param="guided_json")
    err = from_worker_error(WorkerCallError(
        "w:1", "decode", grpc.StatusCode.INVALID_ARGUMENT,
        "response_format: cannot build a grammar from it: bad (field response_format)"), 1)
    named = named_for_request(err, job)
    assert named.param == "guided_json" and "guided_json: cannot build a grammar" in named.message
    assert named_for_request(err, None) is err
