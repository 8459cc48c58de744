"""Sizes of the MoE kernels that the planner needs without importing Triton: the tiled sort's
tile (``kernels._moe_sort_triton``), the size from which it runs and its scratch, the most
pairs the per-pair GEMV form takes, and where the prefill tiles start."""

from __future__ import annotations

SORT_TILE = 128  # pairs a tile
BLOCKED_SORT_MIN_PAIRS = 1024  # below this the all-pairs sort is as fast and needs no scratch
GEMV_MAX_PAIRS = 64  # the per-pair GEMV form's limit (pairs = tokens x top-k)
# above this many (token, expert) pairs a step runs the prefill tiles of the tiled expert GEMMs
# (``_mxfp4_moe_tiles.moe_tiles``); from GEMV_MAX_PAIRS + 1 up to it, the decode tiles
PREFILL_MIN_PAIRS = 256


def sort_scratch_numel(num_pairs: int, num_experts: int) -> int:
    """int32 elements of the counts scratch (0 where the all-pairs sort is used)."""
    if num_pairs < BLOCKED_SORT_MIN_PAIRS:
        return 0
    return (-(-num_pairs // SORT_TILE) + 1) * num_experts
