"""CPU tier of DeepSeek-V4's CUDA-graph decode: the step a graph captures (device tensors only:
cache slots, positions and [B, width] block tables in static buffers, pad rows copying row 0,
the host bookkeeping done by ``before_graph_step``) gives the same hidden states and leaves the
same pool as the eager step, over decode steps that close CSA and HCA windows; and the batched
decode of several sequences equals each sequence's full prefill (the chunk path)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

from engine.config import EngineConfig, KernelChoices
from engine.model_config import ModelConfig
from engine.models.deepseek_v4.family import DeepseekV4Family
from engine.scheduler import ScheduledChunk
from engine.step_batch import StepBatch
from tests.engine.deepseek_v4.conftest import step_batch

BS = 8  # lcm of the config's rates (4, 8)
WIDTH = 6  # blocks per sequence in the static table (48 tokens)
TABLES = {0: [7, 8, 9, 10, 11], 2: [1, 2, 3, 4, 5, 6], 3: [12, 13, 14, 15]}


def _eager_batch(seqs: list[tuple[list[int], int, int]]) -> StepBatch:
    return step_batch(seqs, TABLES)


def _graph_batch(chunks: list[ScheduledChunk], bs: int) -> StepBatch:
    """What engine/cuda_graphs.py hands the family for a replay of size ``bs``: static buffers,
    pad rows copying row 0, placeholder host lists."""
    n = len(chunks)
    order = list(range(n)) + [0] * (bs - n)
    tables = torch.zeros(bs, WIDTH, dtype=torch.int32)
    for i, j in enumerate(order):
        tables[i, : len(chunks[j].block_ids)] = torch.tensor(chunks[j].block_ids)
    return StepBatch(
        input_ids=torch.tensor([chunks[j].token_ids[0] for j in order]),
        positions=torch.tensor([chunks[j].start for j in order]),
        slot_mapping=torch.zeros(bs, dtype=torch.long), query_start_loc=list(range(bs + 1)),
        context_lens=[1] * bs, block_tables=[[0]] * bs, cache_slots=list(range(bs)),
        logits_indices=torch.arange(bs), block_tables_t=tables,
        cache_slots_t=torch.tensor([chunks[j].cache_slot for j in order]))


def test_graph_step_equals_eager_step(v4_builder: Callable[..., Any]) -> None:
    model, raw = v4_builder("s-csa-hca_yarn_hc2")
    mc = ModelConfig.from_hf_dict(model.config.to_dict())
    ec = EngineConfig(model="v4", device="cpu", dtype="float32", max_batch=4, max_context=48,
                      block_size=BS, attn_tile_tokens=BS)
    fam = DeepseekV4Family(mc, dict(model.state_dict()), ec)
    eager = DeepseekV4Family.kv_layout(mc, ec).allocate(16, torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    prompts = {0: 13, 2: 22, 3: 3}  # positions 13 / 22 / 3: windows close at different steps
    for slot, n in prompts.items():
        fam.forward(_eager_batch([(torch.randint(2, 97, (n,), generator=g).tolist(), 0, slot)]),
                    eager, None)
    graph = copy.deepcopy(eager)
    pos = dict(prompts)
    for step in range(9):
        toks = {s: int(torch.randint(2, 97, (1,), generator=g)) for s in pos}
        chunks = [ScheduledChunk(f"r{s}", pos[s], 1, (toks[s],), tuple(TABLES[s]), s, True)
                  for s in (2, 0, 3)]
        want = fam.forward(_eager_batch([([toks[c.cache_slot]], c.start, c.cache_slot)
                                         for c in chunks]), eager, None)
        fam.before_graph_step(graph, chunks)
        got = fam.forward(_graph_batch(chunks, 4), graph, None)
        torch.testing.assert_close(got[:3], want, atol=1e-5, rtol=1e-5, msg=f"step {step}")
        torch.testing.assert_close(got[3], got[0])  # the pad row computes row 0 again
        assert graph.num_tokens == eager.num_tokens
        for a, b in zip(graph.block_tensors() + graph.slot_tensors(),
                        eager.block_tensors() + eager.slot_tensors(), strict=True):
            # block 0 is the null block, the sink of the rows with nothing to write
            torch.testing.assert_close(a[1:], b[1:], atol=1e-5, rtol=1e-5)
        for s in pos:
            pos[s] += 1


@pytest.mark.parametrize("backend,kv_dtype", [
    (None, "auto"),  # PyTorch decode attention over gathered rows
    (KernelChoices("kernels_ref", "kernels_ref"), "auto"),  # the kernel's spec, pool rows by index
    (KernelChoices("kernels_ref", "kernels_ref"), "fp8"),  # FP8 pool: attended rows dequantised
    # the fused decode loop's kernels on an FP8 pool: the indexer kernel dequantises its keys
    (KernelChoices("kernels", "kernels", decode="fused"), "fp8"),
], ids=["torch", "kernels_ref", "kernels_ref_fp8", "fused_kernels_fp8"])
def test_batched_decode_equals_prefill(v4_builder: Callable[..., Any],
                                       backend: KernelChoices | None,
                                       kv_dtype: str) -> None:
    """Three sequences decoded together token by token: each step's logits equal those of the
    same tokens prefilled in one chunk through the per-sequence chunk path."""
    model, raw = v4_builder("csa-hca-csa-s_hc3_topk_all")
    mc = ModelConfig.from_hf_dict(model.config.to_dict())
    ec = EngineConfig(model="v4", device="cpu", dtype="float32", max_batch=4, max_context=48,
                      block_size=16, attn_tile_tokens=16, kv_dtype=kv_dtype,
                      kernels=backend or KernelChoices())
    fam = DeepseekV4Family(mc, dict(model.state_dict()), ec)
    tables = {1: [1, 2, 3], 0: [4, 5, 6], 3: [7, 8, 9]}
    pool = DeepseekV4Family.kv_layout(mc, ec).allocate(10, torch.device("cpu"))
    g = torch.Generator().manual_seed(6)
    seqs = {s: torch.randint(2, 97, (n,), generator=g).tolist() for s, n in ((1, 30), (0, 23), (3, 14))}
    start = {1: 17, 0: 10, 3: 1}  # prefill this much, then decode the rest one token a step
    for s, toks in seqs.items():
        fam.forward(StepBatch(torch.tensor(toks[: start[s]]), torch.arange(start[s]),
                              torch.zeros(start[s], dtype=torch.long), [0, start[s]], [start[s]],
                              [tables[s]], [s], torch.tensor([start[s] - 1])), pool, None)
    logits = {s: [] for s in seqs}
    for k in range(13):
        ids = [seqs[s][start[s] + k] for s in seqs]
        batch = StepBatch(torch.tensor(ids), torch.tensor([start[s] + k for s in seqs]),
                          torch.zeros(3, dtype=torch.long), [0, 1, 2, 3],
                          [start[s] + k + 1 for s in seqs], [tables[s] for s in seqs],
                          list(seqs), torch.arange(3))
        out = fam.compute_logits(fam.forward(batch, pool, None), torch.empty(3, 97))
        for i, s in enumerate(seqs):
            logits[s].append(out[i])
    solo = DeepseekV4Family.kv_layout(mc, ec).allocate(10, torch.device("cpu"))
    for s, toks in seqs.items():
        n = start[s] + 13
        ref = fam.compute_logits(fam.forward(StepBatch(
            torch.tensor(toks[:n]), torch.arange(n), torch.zeros(n, dtype=torch.long), [0, n], [n],
            [tables[s]], [s], torch.arange(n)), solo, None), torch.empty(n, 97))
        torch.testing.assert_close(torch.stack(logits[s]), ref[start[s]:], atol=2e-5, rtol=1e-4)
