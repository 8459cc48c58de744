"""The lightning indexer's decode scores as one kernel per tile: each row's single query against
a tile of its own sequence's compressed entries, read from the paged pool through its block
table (DeepSeek-V4's CSA layers). Unfused that is a gather of the keys, an fp32 copy, a batched
matmul, ReLU, weighting, a sum and a mask, each its own kernel. ``indexer_decode_scores``
scores one tile into ``out`` (no scratch); ``indexer_decode_topk`` walks the whole table width
in tiles and keeps each row's running top-k with the prefill indexer's merge kernel, in
``indexer_decode_topk_workspace_bytes`` of scratch: rows x (tile + top-k) values, never rows x
context. ``kernels.indexer_decode_ref`` is the specification of both.
"""

from __future__ import annotations

import torch

from kernels._checks import check_tensor
from kernels._triton_support import next_pow2, require_triton
from kernels.errors import KernelArgumentError

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def indexer_decode_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                          tables: torch.Tensor, kv_end: torch.Tensor, first: int, num: int,
                          per_block: int, out: torch.Tensor,
                          key_scale: torch.Tensor | None = None) -> torch.Tensor:
    """See ``indexer_decode_scores_ref``; out [B, num] fp32 -> out. ``key_scale`` [rows] fp32:
    ``keys`` are FP8 (e4m3), a row's value its stored value x its scale."""
    name = "indexer_decode_scores"
    dev = q.device
    check_tensor(name, "q", q, shape=(None, None, None), dtypes=_DTYPES, device=dev)
    b, h, d = q.shape
    check_tensor(name, "weights", weights, shape=(b, h), dtypes=(torch.float32,), device=dev)
    if key_scale is None:
        check_tensor(name, "keys", keys, shape=(None, d), dtypes=(q.dtype,), device=dev)
    else:
        check_tensor(name, "keys", keys, shape=(None, d), dtypes=(torch.float8_e4m3fn,),
                     device=dev)
        check_tensor(name, "key_scale", key_scale, shape=(keys.shape[0],),
                     dtypes=(torch.float32,), device=dev)
        if key_scale.stride(0) != 1:
            raise KernelArgumentError(name, "key_scale", "must be contiguous")
    check_tensor(name, "tables", tables, shape=(b, None), dtypes=(torch.int64,), device=dev)
    check_tensor(name, "kv_end", kv_end, shape=(b,), dtypes=(torch.int64,), device=dev)
    check_tensor(name, "out", out, shape=(b, num), dtypes=(torch.float32,), device=dev)
    if per_block <= 0:
        raise KernelArgumentError(name, "per_block", f"must be > 0, got {per_block}")
    if first < 0 or num < 0 or first + num > tables.shape[1] * per_block:
        raise KernelArgumentError(name, "num", f"entries [{first}, {first + num}) outside the "
                                  f"tables' {tables.shape[1] * per_block}")
    if kv_end.stride(0) != 1:
        raise KernelArgumentError(name, "kv_end", f"must be contiguous, got strides {kv_end.stride()}")
    require_triton(name, dev)
    from kernels._indexer_decode_triton import launch_indexer_decode

    if b and num:
        launch_indexer_decode(q, weights, keys, tables, kv_end, first, num, per_block, out,
                              key_scale)
    return out


def _kp(topk: int) -> int:
    return next_pow2(max(topk, 16))


MERGE_PARTS_MAX = 8  # programs a row that may merge one tile's scores, each its slice
MERGE_PART_MIN = 8192  # entries a part's slice holds at least, by default
MERGE_PARTS_DEFAULT_MAX = 4  # (H100, 32768 entries, one row: 1 part 74.6 us, 4 45.3, 8 48.9)


def merge_parts(tile: int) -> int:
    """Programs a row the top-k merge of a ``tile``-entry tile runs on by default: one a
    ``MERGE_PART_MIN`` entries, at most ``MERGE_PARTS_DEFAULT_MAX``; 1 for short tiles (no
    combine launch). At V4-Flash's decode tile (32768 entries, from a 131k-token context) that
    is 4 (lab/results/notebook.md "Fifteenth session")."""
    return max(1, min(MERGE_PARTS_DEFAULT_MAX, tile // MERGE_PART_MIN))


def indexer_decode_topk_workspace_bytes(rows: int, topk: int, tile: int,
                                        parts: int | None = None) -> int:
    """Scratch of :func:`indexer_decode_topk`: per row and merge part (``merge_parts(tile)``
    unless given) the running best and the merge's candidates (int64 keys, ``kp`` and ``2 kp``
    with ``kp`` = top-k rounded up to a power of two), with more than one part the parts'
    combined best (``kp``), a tile's fp32 scores and the best's fp32 scores."""
    kp = _kp(topk)
    parts = merge_parts(tile) if parts is None else parts
    return rows * (tile * 4 + (3 * parts + (parts > 1)) * kp * 8 + topk * 4)


def indexer_decode_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                        tables: torch.Tensor, kv_end: torch.Tensor, per_block: int, topk: int,
                        tile: int, out: torch.Tensor, *, workspace: torch.Tensor | None = None,
                        parts: int | None = None,
                        key_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's ``topk`` highest-scoring entries among the ``tables.shape[1] * per_block``
    its table can hold (visible: < kv_end) -> out [B, topk], best first, ties to the lower
    entry, -1 past the visible ones: int64 ``out`` gets the entry numbers, int32 ``out`` their
    pool rows (``tables[b, e // per_block] * per_block + e % per_block``, the indices the sparse
    attention reads a same-addressed pool by). Scores as ``indexer_decode_scores``; ``tile``
    entries are scored a launch and merged by ``parts`` programs a row (default
    :func:`merge_parts`; the answer is the same whatever the parts). ``workspace``: uint8,
    ``indexer_decode_topk_workspace_bytes`` (allocated here when None). ``key_scale``: FP8
    keys' per-row scales, as in ``indexer_decode_scores``."""
    name = "indexer_decode_topk"
    dev = q.device
    b = q.shape[0]
    check_tensor(name, "out", out, shape=(b, topk), dtypes=(torch.int64, torch.int32), device=dev)
    if tile <= 0 or topk <= 0:
        raise KernelArgumentError(name, "tile", f"tile and topk must be > 0, got {tile}, {topk}")
    num_entries = tables.shape[1] * per_block
    tile = min(tile, max(num_entries, 1))
    parts = merge_parts(tile) if parts is None else parts
    if not 1 <= parts <= MERGE_PARTS_MAX:
        raise KernelArgumentError(name, "parts", f"must be 1..{MERGE_PARTS_MAX}, got {parts}")
    need = indexer_decode_topk_workspace_bytes(b, topk, tile, parts)
    if workspace is None:
        workspace = torch.empty(need, dtype=torch.uint8, device=dev)
    if workspace.dtype != torch.uint8 or workspace.numel() < need or workspace.device != dev:
        raise KernelArgumentError(name, "workspace", f"must be uint8 on {dev} with >= {need} "
                                  f"bytes, got {workspace.dtype} x {workspace.numel()}")
    kp = _kp(topk)
    # int64 keys first (8-byte aligned): the parts' bests, their candidates, the combined best;
    # then the fp32 scores of a tile and of the best
    o = b * parts * kp * 8
    best = workspace[:o].view(torch.int64)
    cand = workspace[o:3 * o].view(torch.int64)
    o = 3 * o
    combined = None
    if parts > 1:
        combined = workspace[o:o + b * kp * 8].view(torch.int64)
        o += b * kp * 8
    scores = workspace[o:o + b * tile * 4].view(torch.float32).view(b, tile)
    o += b * tile * 4
    best_scores = workspace[o:o + b * topk * 4].view(torch.float32).view(b, topk)
    # the scoring kernel's checks, once, on an empty tile
    indexer_decode_scores(q, weights, keys, tables, kv_end, 0, 0, per_block, scores[:, :0],
                          key_scale)
    if not b:
        return out
    from kernels._indexer_decode_triton import launch_indexer_decode_topk

    launch_indexer_decode_topk(q, weights, keys, tables, kv_end, per_block, num_entries, topk, kp,
                               scores, best, cand, best_scores, out, parts, combined, key_scale)
    return out
