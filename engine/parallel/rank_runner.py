"""What every rank does to get ready: its device, its shard of the checkpoint, its own memory plan
(the KV of its heads, its share of the weights, the communication buffers) and a ModelRunner.

Every rank plans with the same engine config, so all ranks hold the same number of KV blocks and
rank 0's block ids mean the same blocks everywhere.
"""

from __future__ import annotations

import dataclasses

import torch

from engine.config import EngineConfig
from engine.memory_planner import MiB, PlanTerm
from engine.model_config import ModelConfig

# NCCL's default per-channel buffer (NCCL_BUFFSIZE) and the channels an all-reduce between GPUs of
# one host may open; NCCL takes these with cudaMalloc, outside PyTorch's allocator.
NCCL_BUFFSIZE = 4 * MiB
NCCL_CHANNELS = 16
# A captured collective's work descriptors: at most NCCL's kernel-argument space (4 KiB) each;
# device memory comes in 2 MiB pages.
NCCL_GRAPH_WORK = 4096
NCCL_GRANULE = 2 * MiB


def rank_device(ec: EngineConfig, rank: int) -> torch.device:
    """Rank r uses the r-th GPU after the configured one (the CPU for every rank on CPU)."""
    dev = ec.torch_device
    if dev.type != "cuda":
        return dev
    return torch.device("cuda", (dev.index or 0) + rank)


def rank_engine_config(ec: EngineConfig, rank: int) -> EngineConfig:
    return dataclasses.replace(ec, device=str(rank_device(ec, rank)))


def comm_terms(model: ModelConfig, ec: EngineConfig, nccl_measured: bool) -> list[PlanTerm]:
    """The communication buffers one rank holds beside its tensors. ``nccl_measured``: the
    start-up's non-torch term already holds NCCL's buffers (measured after its first
    collective), so they are not estimated again."""
    size = ec.tensor_parallel_size
    elem = torch.empty((), dtype=ec.torch_dtype).element_size()
    reduced = ec.chunk_tokens * model.hidden_size * elem
    terms = [PlanTerm("tp.allreduce_staging", reduced,
                      f"one copy of the largest all-reduced tensor: chunk {ec.chunk_tokens} x "
                      f"hidden {model.hidden_size} x {elem} B")]
    if ec.use_cuda_graphs:
        terms.append(graph_collectives_term(model, ec))
    if ec.torch_device.type == "cuda" and not nccl_measured:
        terms.append(PlanTerm("tp.nccl_buffers", 2 * (size - 1) * NCCL_CHANNELS * NCCL_BUFFSIZE,
                              f"2 directions x {size - 1} peer(s) x {NCCL_CHANNELS} channels x "
                              "NCCL_BUFFSIZE 4 MiB (an estimate: a serving start-up measures it "
                              "in non_torch instead)"))
    return terms


def graph_collectives_term(model: ModelConfig, ec: EngineConfig) -> PlanTerm:
    """What NCCL may keep on the device for the all-reduces the decode graphs capture: a
    captured collective's work descriptors are stored with the graph (\"persistent\" plans)
    instead of NCCL's reusable FIFO when they do not fit its kernel arguments."""
    from engine.cuda_graphs import graph_batch_sizes

    graphs = len(graph_batch_sizes(ec.max_batch))
    collectives = 2 * model.num_layers  # the attention output and the MLP/MoE output
    raw = graphs * collectives * NCCL_GRAPH_WORK
    return PlanTerm("tp.graph_collectives", -(-raw // NCCL_GRANULE) * NCCL_GRANULE,
                    f"{graphs} decode graphs x {collectives} all-reduces (2 per layer) x "
                    f"{NCCL_GRAPH_WORK // 1024} KiB of NCCL work descriptors, rounded up to "
                    f"{NCCL_GRANULE // MiB} MiB")


def build_rank_runner(ec: EngineConfig, group):  # noqa: ANN001, ANN201 - RankGroup -> (ModelRunner, ShardPlan)
    """Load this rank's slices, plan, allocate: the ModelRunner of a rank other than 0."""
    from engine.checkpoint import load_checkpoint
    from engine.memory_planner import device_memory, library_workspaces, make_plan
    from engine.model_runner import ModelRunner
    from engine.models import family_class
    from engine.parallel.shard_plan import ShardPlan

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
