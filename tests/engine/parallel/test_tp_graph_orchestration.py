"""Decode CUDA graphs with several ranks, the parts a CPU can check: on CUDA (NCCL) a rank count
above one no longer turns the graphs off while gloo stays eager; every rank derives the same
graph sizes in the same capture order from the engine config it is given; the plan of a rank
counts the graph pool and the captured collectives' NCCL work, and one rank's plan is as before;
the worker setting ``cuda_graphs`` (and ``bulkhead plan --no-cuda-graphs``) turns them off.
The capture and lockstep replay themselves run in tests/engine/parallel/test_tp_cuda_graphs.py
(GPU tier)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.cuda_graphs import capture_order, graph_batch_sizes
from engine.memory_plan import MiB
from engine.parallel.comm_terms import NCCL_GRAPH_WORK
from engine.parallel.rank_runner import rank_engine_config
from engine.plan_cli import main

DATA = Path(__file__).resolve().parents[2] / "data"


def _ec(**kw) -> EngineConfig:
    base = dict(model="unused", device="cuda", dtype="bfloat16", max_context=4096,
                chunk_tokens=512, max_batch=20, block_size=16)
    base.update(kw)
    return EngineConfig(**base)


def test_several_ranks_on_cuda_keep_decode_graphs() -> None:
    assert _ec(tensor_parallel_size=2).use_cuda_graphs
    assert _ec(tensor_parallel_size=4).use_cuda_graphs
    assert not _ec(tensor_parallel_size=2, cuda_graphs=False).use_cuda_graphs
    # the CPU (gloo) and the PyTorch attention path stay eager at any size
    assert not _ec(tensor_parallel_size=2, device="cpu", dtype="float32").use_cuda_graphs
    assert not _ec(tensor_parallel_size=2, attention_backend="torch").use_cuda_graphs


def test_a_gloo_group_cannot_capture(tmp_path) -> None:
    import torch

    from engine.parallel.rank_group import RankGroup

    group = RankGroup(0, 1, torch.device("cpu"), str(tmp_path / "rendezvous"))
    try:
        assert not group.can_capture
    finally:
        group.close()


@pytest.mark.parametrize("max_batch", [1, 7, 20, 64, 130])
def test_every_rank_captures_the_same_sizes_in_the_same_order(max_batch: int) -> None:
    ec = _ec(tensor_parallel_size=4, max_batch=max_batch)
    orders = [capture_order(rank_engine_config(ec, r).max_batch) for r in range(4)]
    assert all(o == orders[0] for o in orders)
    # largest first (the smaller graphs reuse the pool), each size once, the batch itself first
    assert orders[0] == sorted(set(orders[0]), reverse=True)
    assert orders[0][0] == max_batch and orders[0][-1] == 1
    assert sorted(orders[0]) == graph_batch_sizes(max_batch)
    # every rank's device differs, its graph switch does not
    assert {rank_engine_config(ec, r).device for r in range(4)} == {f"cuda:{r}" for r in range(4)}
    assert all(rank_engine_config(ec, r).use_cuda_graphs for r in range(4))


def _terms(capsys, *args: str) -> dict[str, dict]:
    main(["--model", str(DATA / "qwen3-8b-config.json"), "--json", "--max-context", "32768",
          "--chunk-tokens", "2048", "--max-batch", "20", *args])
    return {t["name"]: t for t in json.loads(capsys.readouterr().out)["terms"]}


def test_a_rank_plans_its_graph_pool_and_captured_collectives(capsys) -> None:
    one = _terms(capsys)
    two = _terms(capsys, "--tensor-parallel-size", "2")
    cpu = _terms(capsys, "--tensor-parallel-size", "2", "--device", "cpu", "--dtype", "float32")
    # one rank: the graph pool as before and no communication term at all
    assert "cuda_graph_pool" in one and not [n for n in one if n.startswith("tp.")]
    # two ranks: each rank's pool is its share of a decode step's activations
    assert 0 < two["cuda_graph_pool"]["bytes"] < one["cuda_graph_pool"]["bytes"]
    sizes = len(graph_batch_sizes(20))  # 1 2 4 8 16 20
    raw = sizes * 2 * 36 * NCCL_GRAPH_WORK  # Qwen3-8B: 36 layers, 2 all-reduces each
    assert two["tp.graph_collectives"]["bytes"] == -(-raw // (2 * MiB)) * 2 * MiB
    assert "6 decode graphs x 72 all-reduces" in two["tp.graph_collectives"]["formula"]
    # the CPU path is eager: neither a pool nor captured collectives
    assert "cuda_graph_pool" not in cpu and "tp.graph_collectives" not in cpu


def test_graphs_can_be_turned_off_for_a_worker_and_its_plan(capsys) -> None:
    import dataclasses

    from common.settings import load_worker_settings
    from worker.worker_config import WorkerConfig

    for argv, env in ((["--no-cuda-graphs"], {}), ([], {"BULKHEAD_CUDA_GRAPHS": "false"})):
        s = load_worker_settings("decode", argv, env=env)
        ec = WorkerConfig.from_settings(dataclasses.replace(s, model="/m", device="cuda")).engine
        assert ec.cuda_graphs is False and not ec.use_cuda_graphs
    assert load_worker_settings("decode", [], env={}).cuda_graphs is True
    eager = _terms(capsys, "--tensor-parallel-size", "2", "--no-cuda-graphs")
    assert "cuda_graph_pool" not in eager and "tp.graph_collectives" not in eager
    assert eager["tp.allreduce_staging"]["bytes"] > 0
