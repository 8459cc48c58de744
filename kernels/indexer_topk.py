"""Lightning indexer with an exact running top-k whose scratch never depends on context length.

``indexer_topk`` computes, per query row t, the ``topk`` keys s < kv_end[t] with the highest
``I[t, s] = sum_h weights[t, h] * ReLU(q[t, h, :] . k[s, :])`` (fp32 accumulation of bf16/fp16
inputs), ties broken by the lower index; rows with fewer than ``topk`` visible keys are padded
with index -1 and score -inf. Keys are walked in tiles of ``TILE_W``; each tile's scores go to a
[S, TILE_W] fp32 scratch and are merged into a running best list, so the scratch is
``indexer_topk_workspace_bytes(...)`` bytes at 16k and at 1M context alike. The reference is
``kernels.indexer_topk_ref`` (the specification). Callers fold any scaling (softmax scale,
1/sqrt(H)) into ``weights``: a positive factor commutes with ReLU. FP8 inputs (e4m3) take a
per-(token, head) ``q_scale`` and a per-key ``k_scale``, as DeepSeek-V3.2/V4 quantise them.

This module must never allocate when ``workspace`` and the output buffers are given, and never
build anything shaped [S, T] or [S, H, T].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._checks import check_contiguous, check_positive, check_tensor
from kernels._triton_support import next_pow2, require_triton
from kernels.errors import KernelArgumentError

_NAME = "indexer_topk"


@dataclass(frozen=True)
class IndexerTiles:
    """Tile constants of the indexer: they change speed (and ``tile_w`` the scratch size), never
    the answer: the running merge is exact."""

    tile_w: int = 16384  # keys per scratch tile: scratch is rows x tile_w fp32
    block_m: int = 64  # query rows per scoring program
    block_n: int = 128  # keys per scoring program
    num_warps: int = 4  # (64, 128, 4, 2): fastest of 7 configurations on the H200, 2026-12-02
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("tile_w", "block_m", "block_n", "num_warps", "num_stages"):
            check_positive(_NAME, f"tiles.{name}", getattr(self, name))
        if self.tile_w % self.block_n:
            raise KernelArgumentError(_NAME, "tiles.tile_w", "must be a multiple of block_n")
        if self.block_m < 16 or self.block_n < 16:
            raise KernelArgumentError(_NAME, "tiles", "block_m and block_n must be >= 16")


DEFAULT_TILES = IndexerTiles()


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _scratch_width(num_keys: int, tiles: IndexerTiles) -> int:
    return min(tiles.tile_w, _round_up(max(num_keys, 1), tiles.block_n))


def indexer_topk_workspace_bytes(
    num_rows: int,
    num_heads: int,
    head_dim: int,
    num_keys: int,
    topk: int,
    *,
    tiles: IndexerTiles = DEFAULT_TILES,
) -> int:
    """Bytes of ``workspace`` that ``indexer_topk`` needs; flat in ``num_keys`` past one tile.

    scores [S, min(T, tile_w)] fp32 + best [S, KP] int64 + candidates [S, 2 KP] int64, where
    KP = next power of two >= topk. (``num_heads``/``head_dim`` do not change it today.)
    """
    del num_heads, head_dim
    kp = next_pow2(max(topk, 16))
    return num_rows * _scratch_width(num_keys, tiles) * 4 + num_rows * kp * 8 * 3


def indexer_topk(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    kv_end: torch.Tensor,
    topk: int,
    *,
    out_indices: torch.Tensor | None = None,
    out_scores: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    q_scale: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    tiles: IndexerTiles = DEFAULT_TILES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the lightning-indexer scores per row: (scores [S, topk] fp32, indices int32).

    Args: q [S, H, D] bf16/fp16/fp32 (last dim contiguous); k [T, D] same dtype; weights
    [S, H] fp32/bf16; kv_end [S] int32 (row t sees keys [0, kv_end[t]), clipped to T);
    topk >= 1; out_indices [S, topk] int32, out_scores [S, topk] fp32 (allocated if None);
    workspace: a contiguous uint8 tensor of at least ``indexer_topk_workspace_bytes`` bytes
    (allocated if None).

    FP8 (DeepSeek-V3.2/V4 style): q and k in float8_e4m3fn with ``q_scale`` [S, H] fp32 (one per
    token and head) and ``k_scale`` [T] fp32 (one per key); the scores become
    ``k_scale[s] * sum_h weights[t, h] * q_scale[t, h] * ReLU(q8[t, h] . k8[s])``, which is
    ``sum_h w * ReLU((q_scale q8) . (k_scale k8))`` for positive scales. Either scale may be
    given with any input dtype.
    """
    if not isinstance(topk, int) or topk < 1:
        raise KernelArgumentError(_NAME, "topk", f"must be an int >= 1, got {topk!r}")
    dev = q.device
    floats = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
    check_tensor(_NAME, "q", q, shape=(None, None, None), dtypes=floats, device=dev)
    num_rows, num_heads, head_dim = q.shape
    check_tensor(_NAME, "k", k, shape=(None, head_dim), dtypes=(q.dtype,), device=dev)
    check_tensor(_NAME, "weights", weights, shape=(num_rows, num_heads),
                 dtypes=(torch.float32, torch.bfloat16, torch.float16), device=dev,
                 last_dim_contiguous=False)
    check_tensor(_NAME, "kv_end", kv_end, shape=(num_rows,), dtypes=(torch.int32,), device=dev)
    check_contiguous(_NAME, "kv_end", kv_end)
    if q_scale is not None:
        check_tensor(_NAME, "q_scale", q_scale, shape=(num_rows, num_heads),
                     dtypes=(torch.float32,), device=dev, last_dim_contiguous=False)
    if k_scale is not None:
        check_tensor(_NAME, "k_scale", k_scale, shape=(k.shape[0],), dtypes=(torch.float32,),
                     device=dev)
    if out_indices is None:
        out_indices = torch.empty((num_rows, topk), dtype=torch.int32, device=dev)
    if out_scores is None:
        out_scores = torch.empty((num_rows, topk), dtype=torch.float32, device=dev)
    check_tensor(_NAME, "out_indices", out_indices, shape=(num_rows, topk),
                 dtypes=(torch.int32,), device=dev)
    check_tensor(_NAME, "out_scores", out_scores, shape=(num_rows, topk),
                 dtypes=(torch.float32,), device=dev)
    num_keys = k.shape[0]
    if num_rows == 0:
        return out_scores, out_indices
    if num_keys == 0:
        out_scores.fill_(float("-inf"))
        out_indices.fill_(-1)
        return out_scores, out_indices
    need = indexer_topk_workspace_bytes(num_rows, num_heads, head_dim, num_keys, topk, tiles=tiles)
    if workspace is None:
        workspace = torch.empty(need, dtype=torch.uint8, device=dev)
    check_tensor(_NAME, "workspace", workspace, shape=(None,), dtypes=(torch.uint8,), device=dev)
    check_contiguous(_NAME, "workspace", workspace)
    if workspace.numel() < need:
        raise KernelArgumentError(
            _NAME, "workspace", f"holds {workspace.numel()} bytes, needs {need} "
            f"(indexer_topk_workspace_bytes({num_rows}, {num_heads}, {head_dim}, {num_keys}, {topk}))"
        )
    if workspace.data_ptr() % 16:
        raise KernelArgumentError(_NAME, "workspace", "must be 16-byte aligned")
    require_triton(_NAME, dev)
    from kernels._indexer_triton import IndexerOperands, launch_indexer_topk

    kp = next_pow2(max(topk, 16))
    width = _scratch_width(num_keys, tiles)
    n_scores = num_rows * width * 4
    scores = workspace[:n_scores].view(torch.float32).view(num_rows, width)
    best = workspace[n_scores : n_scores + num_rows * kp * 8].view(torch.int64)
    cand = workspace[n_scores + num_rows * kp * 8 : need].view(torch.int64)
    launch_indexer_topk(
        IndexerOperands(q, k, weights, kv_end, q_scale, k_scale),
        topk=topk, kp=kp,
        scores=scores, best=best, cand=cand, out_scores=out_scores, out_indices=out_indices,
        block_m=tiles.block_m, block_n=tiles.block_n,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out_scores, out_indices
