"""Speculative decoding with n-gram drafts (engine/spec_decode.py, engine/ngram_drafter.py):
greedy outputs token-identical to plain greedy decoding (with drafts accepted, and with every
logits processor on), the rejection sampler against the target distribution over many draws,
grammars with drafts, the rollback of rejected drafts, and what the engine refuses."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from engine.errors import InvalidRequest, PlanError
from engine.grammar import TokenBitmask
from engine.ngram_drafter import NgramDrafter
from engine.sampler import RowState
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.slot_sampling import SlotSampling
from engine.spec_decode import verify
from engine.workspace import Workspace
from tests.engine.conftest import build_tiny_model
from tests.engine.test_engine_vs_transformers import make_engine, run_all

SIZES = dict(max_context=320, chunk_tokens=64, max_batch=4)
# a prompt that repeats itself: random tiny models fall into loops on it, where drafts hit
PROMPTS = {f"r{i}": [5 + i, 9, 9, 17, 33, 5, 60, 61, 62, 9, 100, 3] * (1 + i) for i in range(4)}


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def folder(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"{request.param}-spec")
    build_tiny_model(request.param).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def engines(folder):
    return (make_engine(folder, **SIZES),
            make_engine(folder, speculative_method="ngram", num_speculative_tokens=3, **SIZES))


def test_greedy_is_token_identical_and_drafts_are_accepted(engines) -> None:
    plain, spec = engines
    sp = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    want, _ = run_all(plain, PROMPTS, sp)
    before = spec.stats()
    got, reasons = run_all(spec, PROMPTS, sp)
    assert got == want
    assert set(reasons.values()) == {"length"}
    stats = spec.stats()
    drafts = stats.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = stats.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    assert drafts > 0 and accepted > 0, stats
    # fewer steps than tokens: accepted drafts came several to a step
    assert stats.steps_completed - before.steps_completed < 4 * 60
    per_pos = [a - b for a, b in zip(stats.spec_accepted_per_pos,
                                     before.spec_accepted_per_pos or (0, 0, 0), strict=True)]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)


@pytest.mark.parametrize("kw", [
    dict(presence_penalty=0.7, frequency_penalty=0.4),
    dict(repetition_penalty=1.3, logit_bias=((9, 3.0), (61, -2.0))),
    dict(min_tokens=30, logprobs=3),
])
def test_greedy_with_processors_is_identical(engines, kw) -> None:
    """Row j after drafts 1..j is processed as if they were accepted (penalty counts,
    min_tokens); logprobs of every kept token are the plain ones."""
    plain, spec = engines
    sp = SamplingParams(max_tokens=40, temperature=0.0, **kw)
    outs = {}
    for name, eng in (("plain", plain), ("spec", spec)):
        for rid, prompt in PROMPTS.items():
            eng.add_request(f"{name}-{rid}", prompt, sp)
        toks: dict[str, list[int]] = {}
        lps: dict[str, list] = {}
        while eng.has_unfinished():
            for o in eng.step():
                rid = o.request_id.split("-", 1)[1]
                toks.setdefault(rid, []).extend(o.new_token_ids)
                lps.setdefault(rid, []).extend(o.logprobs or [])
        outs[name] = (toks, lps)
    assert outs["spec"][0] == outs["plain"][0]
    if "logprobs" in kw:
        for rid in PROMPTS:
            a, b = outs["plain"][1][rid], outs["spec"][1][rid]
            assert len(a) == len(b) == len(outs["plain"][0][rid])
            for x, y in zip(a, b, strict=True):
                assert x.token_id == y.token_id
                assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
                assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_request_override_and_limit(engines) -> None:
    plain, spec = engines
    sp = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    off = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                         num_speculative_tokens=0)
    before = spec.stats().spec_num_drafts
    got, _ = run_all(spec, {"off": PROMPTS["r1"]}, off)
    assert spec.stats().spec_num_drafts == before  # the request asked for none
    want, _ = run_all(plain, {"off": PROMPTS["r1"]}, sp)
    assert got == want
    with pytest.raises(InvalidRequest, match="num_speculative_tokens=4 is above this worker's "
                                             "limit of 3"):
        spec.add_request("x", [1, 2, 3], SamplingParams(num_speculative_tokens=4))
    with pytest.raises(InvalidRequest, match="limit of 0"):
        plain.add_request("y", [1, 2, 3], SamplingParams(num_speculative_tokens=1))


def test_sampling_with_drafts_runs_and_is_reproducible(engines) -> None:
    _, spec = engines
    sp = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True,
                        presence_penalty=0.3)
    a, _ = run_all(spec, {"s1": PROMPTS["r2"]}, sp)
    b, _ = run_all(spec, {"s2": PROMPTS["r2"]}, sp)
    assert a["s1"] == b["s2"] and len(a["s1"]) == 40


def test_mtp_and_unknown_methods_are_refused(folder) -> None:
    # a dense family has no MTP layers (DeepSeek-V4's: tests/engine/deepseek_v4/test_v4_mtp.py)
    with pytest.raises(PlanError, match="speculative_method=mtp: family .* drafts with ngram only"):
        make_engine(folder, speculative_method="mtp", **SIZES)
    with pytest.raises(PlanError, match="speculative_method must be one of none, ngram, mtp"):
        make_engine(folder, speculative_method="eagle", **SIZES)
    with pytest.raises(PlanError, match=r"num_speculative_tokens must be in \[1, 16\]"):
        make_engine(folder, speculative_method="ngram", num_speculative_tokens=0, **SIZES)


# -- the rejection sampler against the target distribution ------------------------------------
def _target(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The textbook distribution: softmax(logits / T), restricted to the smallest set of most
    likely tokens whose mass reaches top_p, renormalised."""
    p = torch.softmax(logits.double() / temperature, dim=-1)
    vals, order = torch.sort(p, descending=True)
    cut = int(torch.searchsorted(torch.cumsum(vals, 0), torch.tensor(top_p, dtype=torch.double)))
    keep = torch.zeros_like(p)
    keep[order[: cut + 1]] = 1
    p = p * keep
    return p / p.sum()


@pytest.mark.parametrize("case", ["plain", "top_p_presence"])
def test_rejection_sampler_preserves_the_target_distribution(case) -> None:
    """Many sequences with the same two rows and drafts: the first kept token follows p_0 and,
    where the draft was accepted, the second follows p_1 (processed as if the draft were
    accepted). Total variation within what sampling noise allows at this many draws."""
    vocab, n = 6, 6000
    g = torch.Generator().manual_seed(0)
    row0, row1 = torch.randn(vocab, generator=g) * 1.5, torch.randn(vocab, generator=g) * 1.5
    draft = (int(torch.argsort(row0)[-1]), int(torch.argsort(row1)[-2]))  # plausible drafts
    presence = 0.0 if case == "plain" else 1.5
    kw = dict(temperature=0.9) if case == "plain" else dict(temperature=0.7, top_p=0.85,
                                                            presence_penalty=presence)
    sp = SamplingParams(max_tokens=8, **kw)
    ws = Workspace(64 << 20, "cpu")
    state = SlotSampling(n, vocab, torch.device("cpu"), stage_tokens=64)
    bitmask = TokenBitmask(3 * n, vocab, torch.device("cpu"))
    with ws.scope():
        for slot in range(n):
            state.admit(slot, sp, [0], [], [], ws)
    logits = torch.stack([row0, row1, row0]).repeat(n, 1)
    gen = torch.Generator().manual_seed(1)
    with ws.scope():
        res = verify(logits, [sp] * n, [draft] * n, [gen] * n, ws,
                     [RowState(i, 0) for i in range(n)], state, bitmask)
    assert not res.errors
    p0 = _target(row0, sp.temperature, sp.top_p)
    bumped = row1.clone()
    bumped[draft[0]] -= presence  # row 1 comes after draft 1: presence counts it
    p1 = _target(bumped, sp.temperature, sp.top_p)
    p2 = _target(row0 - presence * torch.nn.functional.one_hot(
        torch.tensor(list(set(draft))), vocab).sum(0), sp.temperature, sp.top_p)
    first = np.bincount([t[0] for t in res.tokens], minlength=vocab) / n
    tv0 = 0.5 * np.abs(first - p0.numpy()).sum()
    seconds = [t[1] for t in res.tokens if len(t) > 1]
    second = np.bincount(seconds, minlength=vocab) / len(seconds)
    tv1 = 0.5 * np.abs(second - p1.numpy()).sum()
    thirds = [t[2] for t in res.tokens if len(t) > 2]
    # sqrt(vocab / draws) bounds the expected TV of an empirical distribution; 3x of slack
    assert tv0 < 3 * (vocab / n) ** 0.5 * 0.5, (first, p0)
    assert tv1 < 3 * (vocab / len(seconds)) ** 0.5 * 0.5, (second, p1)
    if len(thirds) > 500:
        third = np.bincount(thirds, minlength=vocab) / len(thirds)
        assert 0.5 * np.abs(third - p2.numpy()).sum() < 3 * (vocab / len(thirds)) ** 0.5 * 0.5
    # the acceptance rate of draft 1 is p_0(draft 1), as rejection sampling says
    accepted = len(seconds) / n
    assert accepted == pytest.approx(float(p0[draft[0]]), abs=4 * (0.25 / n) ** 0.5)
    # penalty counts got every kept token once
    kept = sum(len(t) for t in res.tokens)
    assert int(state.counts.sum()) == (kept if sp.uses_counts else 0)
    # a draft outside the top-p set has no mass under the target: it is never kept
    if sp.top_p < 1.0:
        least = int(torch.argsort(row0)[0])
        with ws.scope():
            res = verify(torch.stack([row0, row1]).repeat(500, 1), [sp] * 500, [(least,)] * 500,
                         [gen] * 500, ws, [RowState(i, 0) for i in range(500)], state, bitmask)
        assert all(t[0] != least and len(t) == 1 for t in res.tokens)


# -- grammars ---------------------------------------------------------------------------------
pytest.importorskip("xgrammar")
from tests.engine.json_vocab import (  # noqa: E402
    EOS,
    SCHEMA,
    VOCAB,
    compile_schema,
    json_vocab_compiler,
)


@pytest.fixture(scope="module")
def compiled():
    return compile_schema(json_vocab_compiler(), SCHEMA)


def _grammar_run(engine, rid, prompt, sp, compiled) -> list[int]:
    engine.add_request(rid, prompt, sp, grammar=compiled)
    ids: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            ids += o.new_token_ids
            assert o.error is None, o.error
    return ids


@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(temperature=1.0, seed=3)])
def test_json_schema_output_stays_valid_with_drafts(engines, compiled, kw) -> None:
    """The prompt holds a schema object already, so n-gram drafts propose its pieces; drafts
    the grammar refuses are cut before the step, and the matcher moves over kept tokens only."""
    plain, spec = engines
    obj = [VOCAB.index(p) for p in ['{"', "n", '":', "1", "2", ",", '"', "ok", '":', "true", ",",
                                    '"', "name", '":', '"', "a", "b", '"', "}"]]
    prompt = [5, 9] + obj + [17, 33] + obj[:3]
    sp = SamplingParams(max_tokens=60, **kw)
    before = spec.stats().spec_num_draft_tokens
    got = _grammar_run(spec, f"g-{kw}", prompt, sp, compiled)
    assert spec.stats().spec_num_draft_tokens > before  # drafts were verified
    value = json.loads("".join(VOCAB[i] for i in got if i != EOS))
    assert set(value) == {"n", "ok", "name"}
    if sp.is_greedy:
        assert got == _grammar_run(plain, f"g-{kw}", prompt, sp, compiled)


# -- bookkeeping ------------------------------------------------------------------------------
def test_drafter_finds_the_latest_earlier_occurrence() -> None:
    d = NgramDrafter(max_batch=2, max_context=64)
    seq = Sequence("a", [1, 2, 3, 4, 9, 1, 2, 3, 7, 8, 1, 2, 3], SamplingParams(), 0)
    d.reset(1)
    d.sync(1, seq)
    assert d.propose(1, 3) == [7, 8, 1]  # "1 2 3" last occurred before "7 8"
    seq.output_token_ids.append(7)
    d.sync(1, seq)
    assert d.propose(1, 5) == [8, 1, 2, 3, 7]
    assert d.propose(0, 3) == []  # an empty slot
    d.reset(0)
    d.sync(0, Sequence("b", [5, 6, 7], SamplingParams(), 0))
    assert d.propose(0, 3) == []  # no earlier match of any suffix


def test_rejected_drafts_are_not_computed_nor_cached(folder) -> None:
    """After a verify step only the last token and the accepted drafts count as computed; the
    blocks registered for the prefix cache hold accepted tokens only."""
    eng = make_engine(folder, speculative_method="ngram", num_speculative_tokens=3, **SIZES)
    sp = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    seen_rejection = False
    for prompt in PROMPTS.values():
        seen_rejection |= _rejections(eng, prompt, sp)
    assert seen_rejection


def _rejections(eng, prompt: list[int], sp: SamplingParams) -> bool:
    eng.add_request("a", prompt, sp)
    seen_rejection = False
    while eng.has_unfinished():
        before = eng.stats()
        running = {s.request_id: s for s in eng.scheduler.running}
        seq = running.get("a")
        start = seq.num_computed_tokens if seq is not None else 0
        eng.step()
        stats = eng.stats()
        drafted = stats.spec_num_draft_tokens - before.spec_num_draft_tokens
        accepted = stats.spec_num_accepted_tokens - before.spec_num_accepted_tokens
        if seq is not None and drafted and seq.status.value == "running":
            assert seq.num_computed_tokens == start + 1 + accepted
            assert seq.num_computed_tokens == seq.num_tokens - 1
            seen_rejection |= accepted < drafted
            full = seq.num_computed_tokens // eng.config.block_size
            assert len(seq.block_hashes) == full
    return seen_rejection
