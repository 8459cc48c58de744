"""A stable counting sort of (token, expert) pairs by expert for prefill-sized steps, in three
small Triton launches and O(pairs x experts / tile) work (see ``kernels.mxfp4_moe``).

The all-pairs sort of ``_mxfp4_moe_triton`` ranks each pair by comparing it with every earlier
pair: O(pairs^2 / 2) compares, which is nothing at decode (<= 256 pairs) and ~0.6 ms a layer at
a 4096-token chunk x top-6 on an H200. Here the pairs are cut into tiles of ``SORT_TILE``:
1. ``_tile_count_kernel``: per tile, how many of its pairs go to each expert -> counts[t, e];
2. ``_tile_scan_kernel``: per expert, an exclusive prefix of counts over the tiles (in place) and
   the expert's total in a last row;
3. ``_tile_order_kernel``: a pair's rank = its expert's start (a prefix of the totals) + the
   pairs of earlier tiles with its expert + the earlier pairs of its own tile with its expert
   (a [tile, tile] compare). Tile 0 also writes ``row_end``.
The result is the same permutation as ``torch.sort(ids, stable=True)``. Scratch: ``counts``
[(tiles + 1) x experts] int32 from the caller (``sort_scratch_numel``). An id outside [0, E) is
dropped, as in the all-pairs sort. Never allocates, never syncs with the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton_support import next_pow2
from kernels.moe_sort_sizes import BLOCKED_SORT_MIN_PAIRS, SORT_TILE, sort_scratch_numel  # noqa: F401

_COUNT_EXPERTS = 128  # experts a compare tile of the count kernel
_SCAN_EXPERTS = 32  # experts a program of the scan
_SCAN_TILES = 64  # tiles a trip of the scan (at 256 it spilled 436 B on sm_90)


@triton.jit
def _tile_count_kernel(ids_ptr, counts_ptr, M, E, TILE: tl.constexpr, EB: tl.constexpr):
    """counts[t, e] = #{pairs of tile t with expert e}."""
    t = tl.program_id(0)
    i = t * TILE + tl.arange(0, TILE)
    id_i = tl.load(ids_ptr + i, mask=i < M, other=-1).to(tl.int32)
    for e0 in range(0, E, EB):
        e = e0 + tl.arange(0, EB)
        cnt = tl.sum((id_i[:, None] == e[None, :]).to(tl.int32), 0)
        tl.store(counts_ptr + t * E + e, cnt, mask=e < E)


@triton.jit
def _tile_scan_kernel(counts_ptr, NT, E, EB: tl.constexpr, TB: tl.constexpr):
    """counts[t, e] -> sum over tiles t' < t of counts[t', e], in place; counts[NT, e] = total."""
    e = tl.program_id(0) * EB + tl.arange(0, EB)
    e_ok = e < E
    carry = tl.zeros((EB,), dtype=tl.int32)
    for t0 in range(0, NT, TB):
        t = t0 + tl.arange(0, TB)
        ok = (t < NT)[:, None] & e_ok[None, :]
        ptrs = counts_ptr + t[:, None] * E + e[None, :]
        c = tl.load(ptrs, mask=ok, other=0)
        tl.store(ptrs, tl.cumsum(c, 0) - c + carry[None, :], mask=ok)
        carry += tl.sum(c, 0)
    tl.store(counts_ptr + NT * E + e, carry, mask=e_ok)


@triton.jit
def _tile_order_kernel(ids_ptr, counts_ptr, row_end_ptr, order_ptr, M, E, NT,
                       TILE: tl.constexpr, E_P2: tl.constexpr):
    """order[rank of pair i] = i; tile 0 writes row_end[e] = pairs with expert <= e."""
    t = tl.program_id(0)
    ex = tl.arange(0, E_P2)
    total = tl.load(counts_ptr + NT * E + ex, mask=ex < E, other=0)
    if t == 0:
        tl.store(row_end_ptr + ex, tl.cumsum(total, 0), mask=ex < E)
    jj = tl.arange(0, TILE)
    i = t * TILE + jj
    id_i = tl.load(ids_ptr + i, mask=i < M, other=-1).to(tl.int32)
    i_ok = (i < M) & (id_i >= 0) & (id_i < E)
    start = tl.sum(tl.where(ex[None, :] < id_i[:, None], total[None, :], 0), 1)
    before = tl.load(counts_ptr + t * E + id_i, mask=i_ok, other=0)
    same = (id_i[None, :] == id_i[:, None]) & (jj[None, :] < jj[:, None])
    rank = start + before + tl.sum(same.to(tl.int32), 1)
    tl.store(order_ptr + rank, i.to(tl.int64), mask=i_ok)


def launch_tiled_sort(ids: torch.Tensor, order: torch.Tensor, row_end: torch.Tensor,
                      counts: torch.Tensor, num_experts: int) -> None:
    """ids [P] int64 -> row_end [E] int32, order [P] int64 (stable); ``counts`` int32 of at
    least ``sort_scratch_numel(P, E)`` elements."""
    m = ids.numel()
    nt = triton.cdiv(m, SORT_TILE)
    assert counts.dtype == torch.int32 and counts.numel() >= (nt + 1) * num_experts, counts.shape
    _tile_count_kernel[(nt,)](ids, counts, m, num_experts, TILE=SORT_TILE,
                              EB=min(_COUNT_EXPERTS, next_pow2(num_experts)))
    _tile_scan_kernel[(triton.cdiv(num_experts, _SCAN_EXPERTS),)](
        counts, nt, num_experts, EB=_SCAN_EXPERTS, TB=_SCAN_TILES)
    _tile_order_kernel[(nt,)](ids, counts, row_end, order, m, num_experts, nt, TILE=SORT_TILE,
                              E_P2=next_pow2(num_experts))


# Where a GEMM program's rows are in the sort's output: both expert GEMMs (the MXFP4 and the
# FP8 prefill form) walk ``row_end`` the same way.
@triton.jit
def _expert_tile(row_end_ptr, t, E, BLOCK_M: tl.constexpr, E_P2: tl.constexpr):
    """Tile ``t`` of the expert-sorted rows -> (expert, is_valid, first row, end row)."""
    ids = tl.arange(0, E_P2)
    ok = ids < E
    end = tl.load(row_end_ptr + ids, mask=ok, other=0)
    start = tl.load(row_end_ptr + ids - 1, mask=ok & (ids > 0), other=0)
    end = tl.where(ok, end, 0)
    start = tl.where(ok, start, 0)
    tiles = (end - start + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles, 0)
    tile_end = tl.where(ok, tile_end, 2147483647)
    e = tl.sum((tile_end <= t).to(tl.int32), 0)
    here = ids == e
    first_tile = tl.sum(tl.where(here, tile_end - tiles, 0), 0)
    row0 = tl.sum(tl.where(here, start, 0), 0) + (t - first_tile) * BLOCK_M
    return e, e < E, row0, tl.sum(tl.where(here, end, 0), 0)
