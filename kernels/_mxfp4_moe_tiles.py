"""Which tiles the MXFP4 MoE GEMMs take (``_mxfp4_moe_triton``), by pairs, hidden width and
experts: the per-pair GEMV form for a decode step's few pairs, the swapped 16-row tiles beyond,
the prefill tiles from ``PREFILL_MIN_PAIRS``. Host-side arithmetic only.
"""

from __future__ import annotations

from kernels._triton_support import interpreting
from kernels.moe_sort_sizes import GEMV_MAX_PAIRS, PREFILL_MIN_PAIRS

# BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, swap[, scaled]]; BLOCK_M 1 is the per-pair
# GEMV form (no sort, no MMA: ``_moe_gemv_*``), for a decode step's few pairs; swap (default: BLOCK_M <
# 64) makes the decoded weight tile the dot's first operand, so it can stay in registers (wgmma
# takes its A operand from registers) instead of going through shared memory; scaled (default
# off; bf16/fp16 activations only) lets ``tl.dot_scaled`` decode the weights; words decodes
# int32 words straight to bf16; n-first orders the programs N-tiles first (``_tile_ids``)
MoeTiles = tuple[int, ...]


WIDE_ROWS_PER_EXPERT = 160  # mean rows an expert from which the 256-row prefill tiles pay
# prefill tiles: swapped, not dot_scaled, int32 words straight to bf16, N-tiles first; the wide
# ones hold 256 rows (a decoded weight tile feeds twice the rows), their down GEMM its own
PREFILL_TILES: MoeTiles = (128, 128, 128, 8, 3, 1, 0, 1, 1)
WIDE_PREFILL_TILES: MoeTiles = (256, 64, 128, 8, 3, 1, 0, 1, 1)
WIDE_DOWN_TILES: MoeTiles = (128, 128, 128, 8, 3, 0, 0, 1, 1)


def moe_tiles(num_pairs: int, hidden: int = 4096, num_experts: int = 0) -> MoeTiles:
    """Tiles of the gate-up GEMM, and of the down GEMM where :func:`moe_down_tiles` gives it
    no tiles of its own. Up to ``GEMV_MAX_PAIRS`` pairs (8 tokens at top-6) the per-pair
    GEMV form: on the H200 (lab/results/quant_decode_sweep_moe_h200.json) 0.074 against 0.091 ms at
    one token and 0.446 against 0.502 at 8, 1.69 against 1.06 ms at 32 (the tiled form reads
    an expert once for all its rows). Decode beyond (a few rows per expert): 16-row tiles with
    swapped operands; prefill: 128 x 128 x 128 tiles, swapped too, so a decoded weight tile feeds 128
    rows from registers. H200 sweep at 4096 tokens x top-6, 128 experts (lab/results/notebook.md,
    2026-12-04): 7.09 ms swapped against 8.26 ms for the earlier 128 x 128 x 64 unswapped tiles;
    40 KiB of shared memory, so the same tiles fit an SM120's 99 KiB. Since the twelfth session
    (lab/results/notebook.md, H100): the per-pair form at 2 warps with int32-word weights (0.061 ms
    at one token with the gate-up split of ``moe_splits``), and the prefill tiles decode words
    straight to bf16 (6.37 against 6.57 ms at 4096 tokens, 11.03 against 11.58 at 8192).
    Thirteenth session (H100, both GEMMs, 128 experts): the programs N-tiles first (10.23
    against 11.02 ms at 8192 tokens) and, from ``WIDE_ROWS_PER_EXPERT`` mean rows an expert,
    256 x 64 tiles (9.77 at 8192, 5.17 against 5.97 at 4096; at 2048 tokens, 96 rows an
    expert, they lose: 5.01 against 3.21). 80 KiB of shared memory on sm_120."""
    if num_pairs <= GEMV_MAX_PAIRS:  # the 6th element: int32-word decode (``_gemv_acc``)
        return (1, 32, 64, 4, 1, 1) if interpreting() else (1, 16, 256, 2, 3, 1)
    if interpreting():
        return (16, 32, 64, 4, 1) if num_pairs <= PREFILL_MIN_PAIRS else (64, 32, 64, 4, 1)
    if num_pairs <= PREFILL_MIN_PAIRS:
        return 16, 64, 128, 4, 3
    if num_experts and num_pairs >= WIDE_ROWS_PER_EXPERT * num_experts:
        return WIDE_PREFILL_TILES
    return PREFILL_TILES


def moe_down_tiles(gate_up_tiles: MoeTiles) -> MoeTiles:
    """The down GEMM's tiles beside the gate-up GEMM's default ones: its K (the intermediate
    width, 2048 at V4-Flash) is half the gate-up's, and with the 256-row tiles it was faster at
    128 x 128 x 128 unswapped, N-tiles first (H100, 2026-12-06: 9.45 against 9.74 ms for both
    GEMMs at 8192 tokens, 5.18 against 5.23 at 4096); else the gate-up's own."""
    return WIDE_DOWN_TILES if gate_up_tiles == WIDE_PREFILL_TILES else gate_up_tiles
