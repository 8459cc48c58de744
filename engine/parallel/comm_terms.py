"""The plan terms of tensor parallelism: the communication buffers one rank holds beside its
tensors (the planner adds them to every rank's plan when ``tensor_parallel_size`` > 1).

Plain arithmetic over the configs; imports no collective library and starts no rank.
"""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.cuda_graphs import graph_batch_sizes
from engine.memory_plan import MiB, PlanTerm
from engine.model_config import ModelConfig

# NCCL's default per-channel buffer (NCCL_BUFFSIZE) and the channels an all-reduce between GPUs of
# one host may open; NCCL takes these with cudaMalloc, outside PyTorch's allocator.
NCCL_BUFFSIZE = 4 * MiB
NCCL_CHANNELS = 16
# A captured collective's work descriptors: at most NCCL's kernel-argument space (4 KiB) each;
# device memory comes in 2 MiB pages.
NCCL_GRAPH_WORK = 4096
NCCL_GRANULE = 2 * MiB


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
    graphs = len(graph_batch_sizes(ec.max_batch))
    collectives = 2 * model.num_layers  # the attention output and the MLP/MoE output
    raw = graphs * collectives * NCCL_GRAPH_WORK
    return PlanTerm("tp.graph_collectives", -(-raw // NCCL_GRANULE) * NCCL_GRANULE,
                    f"{graphs} decode graphs x {collectives} all-reduces (2 per layer) x "
                    f"{NCCL_GRAPH_WORK // 1024} KiB of NCCL work descriptors, rounded up to "
                    f"{NCCL_GRANULE // MiB} MiB")
