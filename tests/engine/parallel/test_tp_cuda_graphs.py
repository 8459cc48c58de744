"""GPU tier: decode CUDA graphs through the tensor-parallel code path, the all-reduce captured.

On one GPU the rank path runs as a group of one over NCCL (``Ranks`` with no other rank: the
model built with its ``RankGroup``, every row-parallel output all-reduced through NCCL, the KV
seen through the sharded layout): graph replay gives the eager tokens and logits and the plain
one-rank engine's, with no device allocation after warm-up. With two GPUs the same check runs at
two ranks (followers capture and replay in lockstep); NCCL refuses two ranks on one GPU, so that
test skips on a one-GPU machine."""

from __future__ import annotations

import pytest
import torch

from engine.checkpoint import load_checkpoint
from engine.config import EngineConfig
from engine.cuda_graphs import capture_order
from engine.llm_engine import LLMEngine
from engine.parallel.ranks import Ranks
from engine.sampling_params import SamplingParams
from engine.scoring import drain
from tests.engine.conftest import build_tiny_model
from tests.engine.test_cuda_graphs import decode_step_logits

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [1, 5, 33, 100, 250, 7]  # 6 sequences: the graph of 8 with 2 pad rows


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def checkpoint(request, tmp_path_factory):
    model = build_tiny_model(request.param, hidden_size=256, intermediate_size=704,
                             num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                             vocab_size=4096, num_hidden_layers=3)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return folder


def _ec(folder, tp: int = 1, **kw) -> EngineConfig:
    return EngineConfig(model=str(folder), device="cuda", dtype="bfloat16", max_context=1024,
                        chunk_tokens=512, max_batch=8, block_size=16, strict_allocations=True,
                        tensor_parallel_size=tp, **kw)


def _group_of_one(ec: EngineConfig) -> LLMEngine:
    """The tensor-parallel engine with a world of one rank (NCCL)."""
    ranks = Ranks(ec)
    assert ranks.size == 1 and ranks.group.can_capture
    ckpt = load_checkpoint(ec.model, dtype=ec.torch_dtype, device=ec.torch_device,
                           progress=False)
    return LLMEngine(ec, ckpt.config, ckpt.state_dict, ckpt.model_fingerprint, ranks=ranks)


def _add(engine: LLMEngine, max_tokens: int) -> None:
    g = torch.Generator().manual_seed(3)
    for i, n in enumerate(PROMPTS):
        engine.add_request(f"r{i}", torch.randint(0, 4096, (n,), generator=g).tolist(),
                           SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                          ignore_eos=True))


def _generate(engine: LLMEngine) -> dict[str, list[int]]:
    _add(engine, 40)
    out = drain(engine)
    assert engine.stats().device_allocs_since_warmup == 0
    return out


def _same_start(a: dict[str, list[int]], b: dict[str, list[int]]) -> None:
    """A near-tied argmax of a random tiny model may flip under another reduction order (see
    tests/engine/test_cuda_graphs.py); a wrong graph input diverges at the first tokens."""
    assert a.keys() == b.keys()
    for k in a:
        assert a[k][:4] == b[k][:4], (k, a[k], b[k])


def _step_logits(engine: LLMEngine) -> tuple[torch.Tensor, torch.Tensor]:
    _add(engine, 20)
    return decode_step_logits(engine, 4096)


def test_group_of_one_captures_the_all_reduce(checkpoint) -> None:
    one = LLMEngine.from_config(_ec(checkpoint))
    ref = _generate(one)
    del one
    graphs = _group_of_one(_ec(checkpoint))
    try:
        runner = graphs.runner
        assert runner.tp is not None and runner.use_graphs
        assert runner.graphs is not None and runner.graphs.captured == capture_order(8)
        assert runner.graphs.pool_bytes <= graphs.plan.term("cuda_graph_pool")
        got = _generate(graphs)
        assert runner.num_graph_steps > 30
        print(f"TPGRAPH world=1 {checkpoint.name}: pool {runner.graphs.pool_bytes} B of "
              f"{graphs.plan.term('cuda_graph_pool')} planned, outside PyTorch "
              f"{runner.graphs.outside_bytes} B, graph steps {runner.num_graph_steps}")
    finally:
        graphs.close()
    eager = _group_of_one(_ec(checkpoint, cuda_graphs=False))
    try:
        assert eager.runner.graphs is None
        _same_start(got, _generate(eager))
    finally:
        eager.close()
    _same_start(got, ref)


def test_group_of_one_graph_logits_equal_eager(checkpoint) -> None:
    engine = _group_of_one(_ec(checkpoint))
    try:
        replayed, eager = _step_logits(engine)
    finally:
        engine.close()
    torch.testing.assert_close(replayed, eager, rtol=3e-2, atol=3e-2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two ranks need two GPUs (NCCL)")
def test_two_ranks_replay_in_lockstep(checkpoint) -> None:
    two = LLMEngine.from_config(_ec(checkpoint, 2))
    try:
        assert two.runner.graphs is not None and two.plan.term("tp.graph_collectives") > 0
        got = _generate(two)
        assert two.runner.num_graph_steps > 30
        print(f"TPGRAPH world=2 {checkpoint.name}: pool {two.runner.graphs.pool_bytes} B, "
              f"outside PyTorch {two.runner.graphs.outside_bytes} B of "
              f"{two.plan.term('tp.graph_collectives')} planned")
        replayed, eager = _step_logits(two)
    finally:
        two.close()
    torch.testing.assert_close(replayed, eager, rtol=3e-2, atol=3e-2)
    eager_two = LLMEngine.from_config(_ec(checkpoint, 2, cuda_graphs=False))
    try:
        _same_start(got, _generate(eager_two))
    finally:
        eager_two.close()
