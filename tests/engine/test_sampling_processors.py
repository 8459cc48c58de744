"""Penalties, logit bias, min_p, min_tokens and logprobs through the engine, against a reference
written here from transformers' logits (a fresh full forward per step, the textbook formulas).
Each test fails if its parameter were ignored."""

from __future__ import annotations

import pytest
import torch

from engine.errors import InvalidRequest
from engine.sampling_params import SamplingParams
from tests.engine.conftest import saved_tiny_model
from tests.engine.test_engine_vs_transformers import make_engine, run_all

EOS = 2


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return saved_tiny_model(tmp_path_factory, "qwen2", "qwen2-proc")


@pytest.fixture(scope="module")
def engine(qwen2):
    return make_engine(qwen2[1], max_context=256, chunk_tokens=32, max_batch=4)


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def reference_greedy(model, prompt: list[int], n: int, *, presence=0.0, frequency=0.0,
                     repetition=1.0, bias=(), min_tokens=0) -> list[int]:
    """Greedy decoding with vLLM's order: repetition over prompt + output, then frequency and
    presence over the output, then logit bias, then EOS held back below min_tokens."""
    out: list[int] = []
    for _ in range(n):
        logits = hf_logits(model, prompt + out)
        seen = set(prompt) | set(out)
        for t in seen:
            v = logits[t]
            logits[t] = v / repetition if v > 0 else v * repetition
        for t in set(out):
            logits[t] -= frequency * out.count(t) + presence
        for t, b in bias:
            logits[t] += b
        if len(out) < min_tokens:
            logits[EOS] = float("-inf")
        out.append(int(logits.argmax()))
        if out[-1] == EOS:
            break
    return out


PROMPT = [5, 9, 9, 17, 33, 5, 60, 61, 62, 9, 100, 3]


def greedy(engine, rid: str, prompt: list[int], n: int = 12, **kw) -> list[int]:
    out, _ = run_all(engine, {rid: prompt}, SamplingParams(max_tokens=n, temperature=0.0,
                                                          ignore_eos=True, **kw))
    return out[rid]


def test_logit_bias_changes_the_greedy_token(qwen2, engine) -> None:
    plain = greedy(engine, "lb0", PROMPT, n=1)
    banned = greedy(engine, "lb1", PROMPT, n=1, logit_bias=((plain[0], -100.0),))
    assert banned != plain
    assert banned == reference_greedy(qwen2[0], PROMPT, 1, bias=((plain[0], -100.0),))
    forced = greedy(engine, "lb2", PROMPT, n=3, logit_bias=((77, 100.0),))
    assert forced == [77, 77, 77]


@pytest.mark.parametrize("kw", [
    dict(repetition=1.8), dict(frequency=1.5), dict(presence=2.0),
    dict(repetition=0.7, frequency=-0.5, presence=0.5, bias=((40, 3.0), (41, -2.0))),
])
def test_penalties_match_the_reference(qwen2, engine, kw) -> None:
    n = 14
    ref = reference_greedy(qwen2[0], PROMPT, n, **kw)
    names = dict(repetition="repetition_penalty", frequency="frequency_penalty",
                 presence="presence_penalty", bias="logit_bias")
    got = greedy(engine, f"pen-{sorted(kw)}", PROMPT, n, **{names[k]: v for k, v in kw.items()})
    assert got == ref
    assert got != reference_greedy(qwen2[0], PROMPT, n)  # the parameter made a difference


def test_penalised_and_plain_rows_share_a_batch(qwen2, engine) -> None:
    """A penalised sequence and plain ones in one step; slots are reused afterwards and a plain
    request on a slot a penalised one held is not penalised."""
    prompts = {"a": PROMPT, "b": PROMPT[:7], "c": PROMPT[3:]}
    sps = {"a": SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                               repetition_penalty=1.8, frequency_penalty=1.0),
           "b": SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
           "c": SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                               logit_bias=((50, 4.0),))}
    for rid, p in prompts.items():
        engine.add_request(rid, p, sps[rid])
    out = {rid: [] for rid in prompts}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    m = qwen2[0]
    assert out["a"] == reference_greedy(m, PROMPT, 10, repetition=1.8, frequency=1.0)
    assert out["b"] == reference_greedy(m, PROMPT[:7], 10)
    assert out["c"] == reference_greedy(m, PROMPT[3:], 10, bias=((50, 4.0),))
    for rid in ("d", "e", "f"):  # every slot again, plain
        assert greedy(engine, rid, PROMPT, 10) == reference_greedy(m, PROMPT, 10)


def test_min_tokens_holds_eos_back(qwen2, engine) -> None:
    eos_first = SamplingParams(max_tokens=10, temperature=0.0, logit_bias=((EOS, 30.0),))
    out, reasons = run_all(engine, {"m0": PROMPT}, eos_first)
    assert out["m0"] == [EOS] and reasons["m0"] == "stop"
    held = SamplingParams(max_tokens=10, temperature=0.0, logit_bias=((EOS, 30.0),),
                          min_tokens=4)
    out, reasons = run_all(engine, {"m1": PROMPT}, held)
    assert len(out["m1"]) == 5 and EOS not in out["m1"][:4] and out["m1"][4] == EOS
    assert out["m1"] == reference_greedy(qwen2[0], PROMPT, 10, bias=((EOS, 30.0),),
                                         min_tokens=4)
    # a user stop token is held back the same way
    stop = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                          logit_bias=((90, 30.0),), stop_token_ids=(90,), min_tokens=3)
    out, reasons = run_all(engine, {"m2": PROMPT}, stop)
    assert len(out["m2"]) == 4 and out["m2"][-1] == 90 and 90 not in out["m2"][:3]


def test_min_p_one_keeps_only_the_top_token(engine) -> None:
    plain = greedy(engine, "mp0", PROMPT, 12)
    hot = dict(max_tokens=12, temperature=2.0, ignore_eos=True, seed=3)
    wild, _ = run_all(engine, {"mp1": PROMPT}, SamplingParams(**hot))
    assert wild["mp1"] != plain  # at temperature 2 a random model wanders
    kept, _ = run_all(engine, {"mp2": PROMPT}, SamplingParams(min_p=1.0, **hot))
    assert kept["mp2"] == plain


def test_greedy_logprobs_equal_transformers_log_softmax(qwen2, engine) -> None:
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=5)
    engine.add_request("lp", PROMPT, sp)
    got = []
    while engine.has_unfinished():
        for o in engine.step():
            got += o.logprobs or []
    assert len(got) == 3
    ids = list(PROMPT)
    for lp in got:
        ref = torch.log_softmax(hf_logits(qwen2[0], ids), dim=-1)
        top = torch.topk(ref, 5)
        assert lp.token_id == int(top.indices[0])
        assert abs(lp.logprob - float(ref[lp.token_id])) < 1e-4
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert torch.allclose(torch.tensor([v for _, v in lp.top]), top.values, atol=1e-4)
        ids.append(lp.token_id)


@pytest.mark.parametrize("kw,field", [
    (dict(logit_bias=((1000, 1.0),)), "logit_bias"),
    (dict(logit_bias=((3, 101.0),)), "logit_bias"),
    (dict(min_tokens=20, max_tokens=4), "min_tokens"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(min_p=1.5), "min_p"),
    (dict(logprobs=21), "logprobs"),
])
def test_bad_values_name_the_field(engine, kw, field) -> None:
    with pytest.raises(InvalidRequest) as exc:
        engine.add_request("bad", PROMPT, SamplingParams(**kw))
    assert exc.value.field == field
