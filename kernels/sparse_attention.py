"""DeepSeek-V4 sparse attention (sliding window + indexed / ranged compressed entries), Triton.

What it computes, per query row ``t`` and head ``h`` (this is what transformers'
``DeepseekV4Attention`` computes for its three layer types):

    E_t  = window entries of row t            (raw KV of the last <= sliding_window tokens)
         + compressed_kv[indices[t, j]]       for every j with indices[t, j] >= 0     (CSA)
         + compressed_kv[compressed_start[t] : compressed_end[t]]                     (HCA)
    logit[h, e] = scale * q[t, h, :] . kv[e, :]           (fp32 accumulation)
    p[h, :]     = softmax([logit[h, :], sinks[h]])[:-1]   (the sink joins the denominator only)
    out[t, h]   = sum_e p[h, e] * kv[e, :]

* Shared-KV MQA: one KV head for all query heads, and the same row is both key and value
  (V4 stores K == V, full head_dim, e.g. 512; the model undoes RoPE on the output itself).
* ``sliding_attention`` layers pass only the window; ``compressed_sparse_attention`` adds
  ``indices`` (the indexer's top-k, -1 = skip); ``heavily_compressed_attention`` adds the
  range ``[compressed_start[t], compressed_end[t])`` of visible compressed entries.
  Both kinds may be given at once; an entry is counted once per time it is named.
* Window entries, two addressing modes:
  - flat: ``window_kv [Nw, D]``; row t sees ``window_kv[window_start[t]:window_end[t]]``
    (e.g. a per-chunk buffer holding the previous window-1 tokens followed by the chunk's KV);
  - paged: ``window_kv [num_blocks, block_size, D]`` (or ``[..., 1, D]``, our KV layout with
    one KV head) plus ``window_block_tables [B, max_blocks]`` int32 and ``row_seq [S]`` int32;
    then ``window_start/window_end`` are token positions of sequence ``row_seq[t]``, and
    position p lives at ``window_kv[window_block_tables[row_seq[t], p // block_size],
    p % block_size]``. For V4 causal sliding window W at position p: start = max(0, p-W+1),
    end = p + 1.
* ``compressed_kv [Nc, D]``: any flat table of compressed entries; ``indices`` and the ranges
  are rows of it (add a per-sequence base offset to the indexer's output if the table holds
  several sequences).
* A row with no entries and no sink gets zeros (never NaN).

Memory: with the default single split no scratch at all (the online-softmax state lives in
registers); with ``num_splits`` > 1 a workspace of ``sparse_attention_workspace_bytes(S, H, D,
num_splits)`` bytes. Neither depends on context length. The output is written into ``out``.
This module must never allocate on the hot path (when given a workspace) or import anything
of ours outside ``kernels``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn

import torch

from kernels._checks import check_tensor
from kernels._triton_support import next_pow2, require_triton
from kernels.errors import KernelArgumentError

_NAME = "sparse_attention"
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INT_DTYPES = (torch.int32,)


@dataclass(frozen=True)
class SparseTiles:
    """Tile constants (speed only, never the answer)."""

    max_block_h: int = 32  # query heads per program (>= 16: tl.dot needs 16 rows)
    block_n: int = 32  # KV entries per step
    num_warps: int = 8
    num_stages: int = 2

    def __post_init__(self) -> None:
        if self.max_block_h < 16 or self.max_block_h & (self.max_block_h - 1):
            raise KernelArgumentError(_NAME, "tiles.max_block_h", "must be a power of two >= 16")
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise KernelArgumentError(_NAME, "tiles.block_n", "must be a power of two >= 16")


# Measured on the H200 (2026-12-02, H=64, D=512, 640 entries a row): with many rows one program
# per row holding all 64 heads (one gather of each entry per row) is fastest; with few rows
# (decode) small head blocks give the parallelism.
PREFILL_SPARSE_TILES = SparseTiles(max_block_h=64, block_n=32, num_warps=8, num_stages=2)
DECODE_SPARSE_TILES = SparseTiles(max_block_h=16, block_n=64, num_warps=4, num_stages=2)


def default_sparse_tiles(num_rows: int) -> SparseTiles:
    """The tile constants ``sparse_attention`` uses when none are given."""
    return PREFILL_SPARSE_TILES if num_rows >= 1024 else DECODE_SPARSE_TILES


SPLIT_TARGET_PROGRAMS = 128  # a decode call splits its entry lists until about this many programs
SPLIT_MAX = 16


def decode_attention_splits(num_rows: int, num_heads: int, max_entries: int,
                            tiles: SparseTiles | None = None) -> int:
    """``num_splits`` for a decode-sized call of ``num_rows`` rows attending at most
    ``max_entries`` entries (window + compressed) a row: doubled while the grid (rows x head
    blocks x splits) stays within ``SPLIT_TARGET_PROGRAMS`` and every split keeps at least two
    KV tiles, at most ``SPLIT_MAX``. At batch 1 with V4-Flash's 64 heads one program per 16
    heads leaves 4 programs for the whole attention; the split spreads a CSA row's 640 entries
    over 16 and an HCA row's thousands at long context over 64. 1 (no scratch) for prefill-
    sized calls and short lists."""
    tiles = tiles or default_sparse_tiles(num_rows)
    block_h = min(tiles.max_block_h, max(16, next_pow2(num_heads)))
    programs = num_rows * -(-num_heads // block_h)
    splits = 1
    while (splits < SPLIT_MAX and 2 * splits * programs <= SPLIT_TARGET_PROGRAMS
           and max_entries >= 2 * splits * 2 * tiles.block_n):
        splits *= 2
    return splits


def _missing(argument: str, problem: str) -> NoReturn:
    raise KernelArgumentError(_NAME, argument, problem)


def sparse_attention_workspace_bytes(
    num_rows: int, num_heads: int, head_dim: int, num_splits: int = 1
) -> int:
    """Scratch bytes of ``sparse_attention``: none with one split (online softmax in
    registers); with ``num_splits`` > 1, the partials [S, H, splits] x (pow2(D) + 2) fp32."""
    if num_splits <= 1:
        return 0
    return num_rows * num_heads * num_splits * (next_pow2(max(head_dim, 16)) + 2) * 4


def sparse_attention(
    q: torch.Tensor,
    window_kv: torch.Tensor,
    window_start: torch.Tensor,
    window_end: torch.Tensor,
    *,
    scale: float,
    out: torch.Tensor,
    compressed_kv: torch.Tensor | None = None,
    indices: torch.Tensor | None = None,
    compressed_start: torch.Tensor | None = None,
    compressed_end: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    window_block_tables: torch.Tensor | None = None,
    row_seq: torch.Tensor | None = None,
    tiles: SparseTiles | None = None,
    num_splits: int = 1,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sparse MQA attention of DeepSeek-V4 into ``out`` (see the module docstring).

    Args (shapes): q [S, H, D]; window_kv [Nw, D] (flat) or [num_blocks, block_size, (1,) D]
    (paged); window_start, window_end [S] int32; compressed_kv [Nc, D]; indices [S, K] int32
    (-1 = skip); compressed_start, compressed_end [S] int32; sinks [H] (fp32 logits);
    window_block_tables [B, max_blocks] int32 and row_seq [S] int32 (paged mode only);
    out [S, H, D] (same dtype as q). All on one device; KV dtype == q dtype.
    ``num_splits`` > 1 splits every row's entry lists over that many programs (more parallelism
    when there are few rows, as in decode: :func:`decode_attention_splits` chooses) and needs
    ``workspace`` (uint8, >= ``sparse_attention_workspace_bytes(S, H, D, num_splits)``;
    allocated if None). Returns ``out``.
    """
    num_rows, num_heads, head_dim = q.shape if q.dim() == 3 else (0, 0, 0)
    dev = q.device
    check_tensor(_NAME, "q", q, shape=(None, None, None), dtypes=_FLOAT_DTYPES, device=dev)
    check_tensor(_NAME, "out", out, shape=tuple(q.shape), dtypes=(q.dtype,), device=dev)
    paged = window_block_tables is not None
    if paged:
        if window_kv.dim() == 4 and window_kv.shape[2] == 1:
            window_kv = window_kv[:, :, 0, :]
        check_tensor(_NAME, "window_kv", window_kv, shape=(None, None, head_dim),
                     dtypes=(q.dtype,), device=dev)
        check_tensor(_NAME, "window_block_tables", window_block_tables, shape=(None, None),
                     dtypes=_INT_DTYPES, device=dev)
        if row_seq is None:
            _missing("row_seq", "is required when window_block_tables is given")
        check_tensor(_NAME, "row_seq", row_seq, shape=(num_rows,), dtypes=_INT_DTYPES, device=dev)
    else:
        check_tensor(_NAME, "window_kv", window_kv, shape=(None, head_dim), dtypes=(q.dtype,),
                     device=dev)
    for name, t in (("window_start", window_start), ("window_end", window_end)):
        check_tensor(_NAME, name, t, shape=(num_rows,), dtypes=_INT_DTYPES, device=dev)
    has_idx = indices is not None
    has_range = compressed_start is not None or compressed_end is not None
    if has_idx or has_range:
        if compressed_kv is None:
            _missing("compressed_kv", "is required when indices or a compressed range is given")
        check_tensor(_NAME, "compressed_kv", compressed_kv, shape=(None, head_dim),
                     dtypes=(q.dtype,), device=dev)
    if has_idx:
        check_tensor(_NAME, "indices", indices, shape=(num_rows, None), dtypes=_INT_DTYPES,
                     device=dev)
    if has_range:
        if compressed_start is None or compressed_end is None:
            _missing("compressed_start/compressed_end", "must be given together")
        for name, t in (("compressed_start", compressed_start), ("compressed_end", compressed_end)):
            check_tensor(_NAME, name, t, shape=(num_rows,), dtypes=_INT_DTYPES, device=dev)
    if sinks is not None:
        check_tensor(_NAME, "sinks", sinks, shape=(num_heads,), dtypes=_FLOAT_DTYPES, device=dev)
    if num_splits < 1:
        raise KernelArgumentError(_NAME, "num_splits", f"must be >= 1, got {num_splits}")
    if num_rows == 0 or num_heads == 0:
        return out
    need = sparse_attention_workspace_bytes(num_rows, num_heads, head_dim, num_splits)
    if need and workspace is None:
        workspace = torch.empty(need, dtype=torch.uint8, device=dev)
    if need:
        assert workspace is not None
        check_tensor(_NAME, "workspace", workspace, shape=(None,), dtypes=(torch.uint8,),
                     device=dev)
        if not workspace.is_contiguous() or workspace.numel() < need or workspace.data_ptr() % 8:
            raise KernelArgumentError(
                _NAME, "workspace", f"must be contiguous, 8-byte aligned and hold {need} bytes "
                f"(sparse_attention_workspace_bytes({num_rows}, {num_heads}, {head_dim}, "
                f"{num_splits})), got {workspace.numel()}")
        n_acc = num_rows * num_heads * num_splits * next_pow2(max(head_dim, 16)) * 4
        part_acc = workspace[:n_acc].view(torch.float32)
        part_ml = workspace[n_acc:need].view(torch.float32)
    else:
        part_acc = part_ml = out  # never touched with one split
    require_triton(_NAME, dev)
    tiles = tiles or default_sparse_tiles(num_rows)
    from kernels._sparse_attention_triton import launch_sparse_attention

    dummy = window_start  # a valid pointer for absent optional tensors (never read)
    launch_sparse_attention(
        q=q,
        out=out,
        window_kv=window_kv,
        window_start=window_start,
        window_end=window_end,
        block_tables=window_block_tables if paged else dummy,
        row_seq=row_seq if paged else dummy,
        compressed_kv=compressed_kv if compressed_kv is not None else window_kv,
        indices=indices if has_idx else dummy.view(num_rows, 1),
        compressed_start=compressed_start if has_range else dummy,
        compressed_end=compressed_end if has_range else dummy,
        sinks=sinks if sinks is not None else dummy,
        part_acc=part_acc,
        part_ml=part_ml,
        num_splits=num_splits,
        scale=float(scale),
        paged=paged,
        has_idx=has_idx,
        has_range=has_range,
        has_sink=sinks is not None,
        block_d=next_pow2(max(head_dim, 16)),
        max_block_h=tiles.max_block_h,
        block_n=tiles.block_n,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out

