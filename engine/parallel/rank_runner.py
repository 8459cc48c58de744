"""What every rank does to get ready: its device, its shard of the checkpoint, its own memory plan
(the KV of its heads, its share of the weights, the communication buffers) and a ModelRunner.

Every rank plans with the same engine config, so all ranks hold the same number of KV blocks and
rank 0's block ids mean the same blocks everywhere.
"""

from __future__ import annotations

import dataclasses

import torch

from engine.checkpoint import load_checkpoint
from engine.config import EngineConfig
from engine.memory_planner import device_memory, library_workspaces, make_plan
from engine.model_runner import ModelRunner
from engine.models.family import family_class
from engine.parallel.shard_plan import ShardPlan


def rank_device(ec: EngineConfig, rank: int) -> torch.device:
    """Rank r uses the r-th GPU after the configured one (the CPU for every rank on CPU)."""
    dev = ec.torch_device
    if dev.type != "cuda":
        return dev
    return torch.device("cuda", (dev.index or 0) + rank)


def rank_engine_config(ec: EngineConfig, rank: int) -> EngineConfig:
    return dataclasses.replace(ec, device=str(rank_device(ec, rank)))


def build_rank_runner(ec: EngineConfig, group):  # noqa: ANN001, ANN201 - RankGroup -> (ModelRunner, ShardPlan)
    """Load this rank's slices, plan, allocate: the ModelRunner of a rank other than 0."""
    ec = rank_engine_config(ec, group.rank)
    non_torch = 0
    if ec.torch_device.type == "cuda":
        free, total = torch.cuda.mem_get_info(ec.torch_device)
        non_torch = total - free - torch.cuda.memory_reserved(ec.torch_device)
    ckpt = load_checkpoint(ec.model, dtype=ec.torch_dtype, device=ec.torch_device, progress=False,
                           tensor_parallel=(group.rank, group.size))
    family = family_class(ckpt.config)
    cfg = family.rank_model_config(ckpt.config, group.size)
    shard = ShardPlan(ckpt.config, group.rank, group.size) \
        if family.tensor_parallel_kv == "heads" else None
    weight_bytes = family.resident_weight_bytes(ckpt.state_dict, ec)
    plan = make_plan(cfg, ec, device_memory(ec), weight_bytes, non_torch, library_workspaces(ec))
    plan.check()
    return ModelRunner(cfg, ec, ckpt.state_dict, plan, tp=group), shard
