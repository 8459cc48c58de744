"""Constrained decoding in the engine: the torch bitmask application against xgrammar's own on
awkward shapes, and a random model whose output follows a JSON schema in every sampling mode
(and does not without the grammar). The vocabulary the model's ids spell: tests/engine/json_vocab.py."""

from __future__ import annotations

import json

import pytest
import torch

from engine.grammar import apply_bitmask, bitmask_words
from engine.sampling_params import SamplingParams
from engine.workspace import Workspace
from tests.engine.json_vocab import (
    EOS,
    SCHEMA,
    VOCAB,
    compile_schema,
    json_vocab_compiler,
    tiny_qwen2_engine,
)

xgr = pytest.importorskip("xgrammar")

@pytest.mark.parametrize("n,vocab", [(1, 131), (3, 37), (2, 64), (5, 1000), (4, 33)])
def test_apply_bitmask_matches_xgrammar(n: int, vocab: int) -> None:
    g = torch.Generator().manual_seed(n * vocab)
    logits = torch.randn(n, vocab, generator=g)
    bits = torch.randint(-2**31, 2**31 - 1, (n, bitmask_words(vocab)), dtype=torch.int32,
                         generator=g)
    ref = logits.clone()
    xgr.apply_token_bitmask_inplace(ref, bits.clone(), vocab_size=vocab, backend="torch_native")
    ws = Workspace(1 << 20, "cpu")
    with ws.scope():
        apply_bitmask(logits, bits, torch.arange(32, dtype=torch.int32), ws)
    assert torch.equal(torch.isinf(logits), torch.isinf(ref))
    assert torch.equal(logits[~torch.isinf(logits)], ref[~torch.isinf(ref)])


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return tiny_qwen2_engine(tmp_path_factory, "qwen2-grammar")


@pytest.fixture(scope="module")
def compiled():
    return compile_schema(json_vocab_compiler(), SCHEMA)


def run(engine, rid: str, sp: SamplingParams, grammar=None) -> tuple[str, str]:
    engine.add_request(rid, [5, 9, 17, 33, 60], sp, grammar=grammar)
    ids, reason = [], None
    while engine.has_unfinished():
        for o in engine.step():
            ids += o.new_token_ids
            reason = o.finish_reason or reason
    return "".join(VOCAB[i] for i in ids if i != EOS), reason


@pytest.mark.parametrize("kw", [
    dict(temperature=0.0), dict(temperature=1.0, seed=1), dict(temperature=1.3, seed=2),
    dict(temperature=0.9, top_k=5, seed=3), dict(temperature=1.0, top_p=0.8, min_p=0.05, seed=4),
    dict(temperature=1.0, seed=5, repetition_penalty=1.3, logit_bias=((3, 5.0),)),
])
def test_output_follows_the_schema_in_every_mode(engine, compiled, kw) -> None:
    text, reason = run(engine, f"g-{sorted(kw.items())}", SamplingParams(max_tokens=120, **kw),
                       compiled)
    assert reason == "stop", text
    value = json.loads(text)
    assert set(value) == {"n", "ok", "name"}
    assert isinstance(value["n"], int) and -50 <= value["n"] <= 50
    assert isinstance(value["ok"], bool)
    assert isinstance(value["name"], str) and len(value["name"]) <= 6


def test_without_the_grammar_the_model_rambles(engine) -> None:
    text, _ = run(engine, "free", SamplingParams(max_tokens=40, temperature=1.0, seed=1))
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_constrained_and_free_rows_share_a_step(engine, compiled) -> None:
    sp = SamplingParams(max_tokens=120, temperature=1.0, seed=9)
    engine.add_request("c", [5, 9, 17], sp, grammar=compiled)
    engine.add_request("f", [5, 9, 17], sp)
    out = {"c": [], "f": []}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    json.loads("".join(VOCAB[i] for i in out["c"] if i != EOS))
    # the free row drew from the same seed without a mask: it is not a schema object
    assert "".join(VOCAB[i] for i in out["f"]) != "".join(VOCAB[i] for i in out["c"])
