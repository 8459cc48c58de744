"""Four concurrent DeepSeek-V4 sequences whose contexts add up to the whole pool, through the
real engine (LLMEngine: plan, warm-up, scheduler, pool, batched decode), FP8 KV.

The pool is sized to exactly the blocks of four sequences of different lengths: each prompt is
chosen so that prompt + max_tokens - 1 (the context at its last decode) is a whole number of
blocks, and max_tokens < block_size + 2, so a sequence claims all its blocks when it is admitted
(prompt + 1 tokens) and decodes into its last one. All four are admitted, the pool then has no
free token, and they decode together (steps that give each of them one token); a fifth request,
whose batch slot is free, waits in the queue because the pool cannot hold it (no compute, no
preemption), and runs once a sequence has finished. No device allocation happens after the
warm-up (strict: the engine itself raises on one).

CPU tier: the same at toy sizes. GPU tier (H200): V4-Flash's layer dimensions (sliding, CSA,
HCA layers; 16 experts in the shipped FP8/MXFP4 formats, synthetic values), blocks of 256, a
pool of 131,072 tokens: contexts of 16,384 / 24,576 / 36,864 / 53,248 tokens."""

from __future__ import annotations

import argparse
import time

import pytest
import torch

from engine.sampling_params import SamplingParams

# (device, block size, blocks of each sequence, max_tokens, chunk, weights)
CPU = ("cpu", 32, (5, 7, 9, 11), 33, 64, "bf16")
GPU = ("cuda", 256, (64, 96, 144, 208), 128, 4096, "fp8-mxfp4")


def _engine(device: str, bs: int, blocks: tuple[int, ...], chunk: int, weights: str):  # noqa: ANN202
    from lab.bench.deepseek_v4.decode import build_engine

    tiny = device == "cpu"
    args = argparse.Namespace(
        device=device, dtype="fp32" if tiny else "bf16", layers="SCH", experts=4 if tiny else 16,
        context=max(blocks) * bs + bs, tiny=tiny, chunk=chunk, batch_list=[5], block_size=bs,
        num_blocks=1 + sum(blocks), kv_dtype="fp8", weights=weights)
    engine, _ = build_engine(args)
    assert engine.plan.num_blocks == 1 + sum(blocks)  # the null block and the four sequences
    return engine


def _run(case: tuple) -> dict[str, object]:
    device, bs, blocks, max_tokens, chunk, weights = case
    engine = _engine(device, bs, blocks, chunk, weights)
    assert engine.stats().free_kv_tokens == sum(blocks) * bs
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rids = [f"s{i}" for i in range(4)]
    for rid, k in zip(rids, blocks, strict=True):
        prompt = k * bs - (max_tokens - 1)  # its last decode's context is k whole blocks
        engine.add_request(rid, torch.randint(0, vocab, (prompt,), generator=gen).tolist(), sp)
    engine.add_request("fifth", torch.randint(0, vocab, (bs,), generator=gen).tolist(), sp)
    new = dict.fromkeys([*rids, "fifth"], 0)
    together = full_steps = steps = 0
    fifth_waited_full = False
    t0 = time.perf_counter()
    while new["fifth"] == 0:
        outs = engine.step()
        steps += 1
        for o in outs:
            new[o.request_id] += len(o.new_token_ids)
        st = engine.stats()
        running = [r for r in rids if 0 < new[r] < max_tokens]
        if len(running) == 4 and {o.request_id for o in outs} >= set(rids):
            together += 1  # a step in which all four decoded (each gave one token)
        if st.free_kv_tokens == 0:
            full_steps += 1
            fifth_waited_full |= st.num_waiting == 1 and st.num_running == 4
        assert st.num_preemptions == 0, "the pool holds the four: nothing is preempted"
        assert steps < 10 * (sum(blocks) * bs // (chunk - 4) + 2 * max_tokens)
    elapsed = time.perf_counter() - t0
    # the fifth ran only after a sequence had finished and given its blocks back
    assert max(new[r] for r in rids) == max_tokens
    done = _finish(engine, new, rids)
    return {"together": together, "full_steps": full_steps, "fifth_waited": fifth_waited_full,
            "allocs": engine.stats().device_allocs_since_warmup, "steps": steps, "s": elapsed,
            "done": done}


def _finish(engine, new: dict[str, int], rids: list[str]) -> list[int]:  # noqa: ANN001
    """Step until the four are done; their token counts."""
    while engine.has_unfinished():
        for o in engine.step():
            new[o.request_id] += len(o.new_token_ids)
    return [new[r] for r in rids]


def _check(res: dict[str, object], case: tuple) -> None:
    assert res["together"] > 0, "the four never decoded in the same step"
    assert res["full_steps"] > 0, "the four never filled the pool"
    assert res["fifth_waited"], "the fifth did not wait while the pool was full"
    assert res["done"] == [case[3]] * 4


def test_four_sequences_fill_the_pool_cpu() -> None:
    res = _run(CPU)
    print(res)
    _check(res, CPU)
    assert res["allocs"] is None  # counted on CUDA only


@pytest.mark.gpu
def test_four_sequences_fill_the_pool_h200() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    res = _run(GPU)
    print(f"four sequences of {[k * GPU[1] for k in GPU[2]]} tokens (pool {sum(GPU[2]) * GPU[1]}):"
          f" {res}")
    _check(res, GPU)
    assert res["allocs"] == 0
