"""What ``LLMEngine.from_config`` does before it builds the engine: start the other
tensor-parallel ranks (they load their own slices meanwhile), measure what the CUDA context
takes, and load rank 0's weights; in one-box mode, export the weights once the engine is warm.

Loads and starts processes; never plans or allocates the engine's own tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.checkpoint import LoadedCheckpoint, load_checkpoint, load_model_config
from engine.config import EngineConfig
from engine.memory_planner import resolve_config_before_load
from engine.weight_share import LoadedOrMapped, export

Progress = Callable[[str], None] | None


def start_other_ranks(ec: EngineConfig, progress: Progress) -> tuple[EngineConfig, Any]:
    """With ``tensor_parallel_size`` > 1: ``ec`` with its sizes fixed from the config (every
    rank must plan the same sizes: weights as the config says, rank 0's real plan is checked
    later) and the other ranks, started (engine/parallel/ranks.py). With one rank: ``ec`` as it
    is and None."""
    if ec.tensor_parallel_size == 1:
        return ec, None
    from engine.parallel.ranks import Ranks
    from engine.parallel.shard_plan import check_tensor_parallel

    ec = resolve_config_before_load(ec, load_model_config(ec.model))
    check_tensor_parallel(ec)  # before any process starts
    if progress is not None:
        progress(f"starting {ec.tensor_parallel_size - 1} more tensor-parallel rank(s)")
    return ec, Ranks(ec)


def non_torch_bytes(ec: EngineConfig) -> int:
    """Device memory held outside PyTorch's allocator (the CUDA context, libraries), measured
    before loading; 0 off CUDA."""
    if ec.torch_device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(ec.torch_device)
    return total - free - torch.cuda.memory_reserved(ec.torch_device)


def load_rank0(ec: EngineConfig, progress: Progress) -> LoadedCheckpoint:
    """Rank 0's weights (all of them with one rank), or dummy ones (``load_format=dummy``)."""
    if progress is not None:
        progress(f"making dummy weights for {ec.model} (seed {ec.seed})"
                 if ec.load_format == "dummy" else f"loading weights from {ec.model}")
    ckpt = load_checkpoint(ec.model, dtype=ec.torch_dtype, device=ec.torch_device,
                           tensor_parallel=(0, ec.tensor_parallel_size),
                           load_format=ec.load_format, seed=ec.seed)
    if progress is not None:
        num_bytes = sum(t.numel() * t.element_size() for t in ckpt.state_dict.values())
        progress(f"loaded {len(ckpt.state_dict)} tensors ({num_bytes / 2**20:,.0f} MiB, "
                 f"{ckpt.config.name})")
    return ckpt


def export_if_owned(got: LoadedOrMapped, ec: EngineConfig, progress: Progress) -> None:
    """One-box mode, after the warm-up (importers then measure a settled device): the process
    that loaded the weights exports them for the others."""
    if not got.shared.owned:
        return
    export(got.shared, Path(ec.share_weights),
           {"model": str(ec.model), "model_fingerprint": got.model_fingerprint})
    if progress is not None:
        progress(f"exported the weights for other processes at {ec.share_weights}")
