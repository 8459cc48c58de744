"""A request's numbers or grammar can end only its own sequence: a row that is NaN, masked
entirely, or whose grammar is complete or refuses everything ends with finish_reason "error" (or
"stop" for a complete grammar) and a typed error, while the other rows of the same step go on.
Each case here crashed a worker's step before (issue 39)."""

from __future__ import annotations

import json

import pytest
import torch

from engine.errors import InvalidRequest, SequenceFailed
from engine.sampler import sample, sampler_workspace_bytes
from engine.sampling_params import GREEDY_TEMPERATURE_FLOOR, SamplingParams
from engine.workspace import Workspace
from tests.engine.json_vocab import (
    EOS,
    VOCAB,
    compile_schema,
    json_vocab_compiler,
    tiny_qwen2_engine,
)

pytest.importorskip("xgrammar")

PROMPT = [5, 9, 17, 33, 60]


def test_a_nan_or_masked_row_fails_alone_in_the_sampler() -> None:
    vocab = 50
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    logits[0, 7] = float("nan")
    logits[1] = float("-inf")
    logits[3, 11] = 1e35  # would overflow once divided by the temperature
    params = [SamplingParams(temperature=1.0, seed=1)] * 3 + [SamplingParams(temperature=0.7)]
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    ws = Workspace(sampler_workspace_bytes(vocab, 4), "cpu")
    got = sample(logits, params, gens, ws)
    assert set(got.errors) == {0, 1, 3}
    assert "NaN" in got.errors[0] and "no token is allowed" in got.errors[1]
    assert "out of range" in got.errors[3]
    assert 0 <= got.tokens[2] < vocab


def test_a_tiny_temperature_is_greedy() -> None:
    assert SamplingParams(temperature=1e-45).is_greedy
    assert SamplingParams(temperature=GREEDY_TEMPERATURE_FLOOR / 2).is_greedy
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE_FLOOR).is_greedy
    with pytest.raises(InvalidRequest, match="repetition_penalty"):
        SamplingParams(repetition_penalty=1e-45)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return tiny_qwen2_engine(tmp_path_factory, "qwen2-poison")


@pytest.fixture(scope="module")
def compiler():
    return json_vocab_compiler()


def schema(compiler, s: dict):
    return compile_schema(compiler, s)


def run_beside_a_plain_one(engine, sp: SamplingParams, grammar) -> dict:
    """Run the request and a plain greedy one in the same steps; -> request id -> last output
    (with all its tokens)."""
    engine.add_request("bad", PROMPT, sp, grammar=grammar)
    engine.add_request("plain", PROMPT, SamplingParams(max_tokens=12, temperature=0.0,
                                                       ignore_eos=True))
    last, tokens = {}, {"bad": [], "plain": []}
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
            if o.finished:
                last[o.request_id] = o
    assert last["plain"].finish_reason == "length" and len(tokens["plain"]) == 12
    return {rid: (o, tokens[rid]) for rid, o in last.items()}


def test_temperature_1e_45_runs_greedy(engine) -> None:
    got = run_beside_a_plain_one(engine, SamplingParams(max_tokens=12, temperature=1e-45,
                                                        ignore_eos=True), None)
    assert got["bad"][1] == got["plain"][1]  # the same as temperature 0


def test_min_tokens_past_a_boolean_schema_ends_that_sequence(engine, compiler) -> None:
    sp = SamplingParams(max_tokens=16, temperature=0.7, min_tokens=8, seed=3)
    got = run_beside_a_plain_one(engine, sp, schema(compiler, {"type": "boolean"}))
    out, _ = got["bad"]
    assert out.finish_reason == "error"
    assert isinstance(out.error, SequenceFailed) and "grammar" in str(out.error)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_schema_that_admits_nothing_ends_that_sequence(engine, compiler, temperature) -> None:
    compiled = schema(compiler, {"$ref": "#"})
    got = run_beside_a_plain_one(engine, SamplingParams(max_tokens=16, temperature=temperature,
                                                        seed=1), compiled)
    out, _ = got["bad"]
    assert out.finish_reason == "error" and isinstance(out.error, SequenceFailed)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_ignore_eos_with_a_grammar_stops_when_the_grammar_is_complete(engine, compiler,
                                                                       temperature) -> None:
    compiled = schema(compiler, {"enum": ["ok", "an"]})
    got = run_beside_a_plain_one(engine, SamplingParams(max_tokens=16, temperature=temperature,
                                                        ignore_eos=True, seed=2), compiled)
    out, ids = got["bad"]
    assert out.finish_reason == "stop" and out.error is None
    assert json.loads("".join(VOCAB[i] for i in ids if i != EOS)) in ("ok", "an")


def test_a_grammar_complete_before_the_step_stops_without_a_token(engine, compiler) -> None:
    """A decode worker continuing from the prefill's first token, which ended the grammar."""
    compiled = schema(compiler, {"type": "boolean"})
    true = VOCAB.index("true")
    engine.add_request("cont", PROMPT, SamplingParams(max_tokens=8, temperature=1.0, seed=4,
                                                      ignore_eos=True),
                       grammar=compiled, first_token_id=true)
    ids, last = [], None
    while engine.has_unfinished():
        for o in engine.step():
            ids += o.new_token_ids
            last = o
    # the grammar still wants EOS after "true": the one token is EOS, then it is complete
    assert last.finish_reason == "stop" and last.error is None
    assert all(i == EOS for i in ids)
