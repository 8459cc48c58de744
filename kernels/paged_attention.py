"""Dense paged attention over our KV layout: chunked prefill + decode in one call, and a decode
specialisation with split-KV (flash-decoding). Triton kernels, PyTorch references beside.

KV layout: ``k_cache``/``v_cache`` [num_blocks, block_size, num_kv_heads, head_dim] (one layer's
slice of ``KVCache.data``), in q's dtype or FP8 e4m3fn (``kernels.kv_quant``: scale 1, read by an
upcast); token i of sequence b is at ``[block_tables[b, i // block_size],
i % block_size]``; block 0 is the null block (never read for positions < context_lens[b]).
Sequence b's queries are the LAST q_len of its context_lens[b] tokens, causal; GQA maps query
head h to KV head h // (Hq // Hkv). Scratch is independent of context length: none for
``paged_attention``; ``paged_decode_workspace_bytes(B, Hq, D, num_splits)`` for the decode
split partials. Outputs go into ``out``. This module must never allocate when given buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._checks import check_contiguous, check_tensor
from kernels._triton_support import cdiv, next_pow2, require_triton
from kernels.errors import KernelArgumentError
from kernels.kv_quant import KV_FP8_DTYPE

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class PagedTiles:
    """Tile constants (speed only, never the answer)."""

    block_m: int = 128  # query tokens per prefill program (128, 64, 8, 2: fastest of 4 on H200)
    block_n: int = 64  # KV tokens per inner step
    num_warps: int = 8
    num_stages: int = 2
    decode_block_n: int = 64
    decode_num_warps: int = 4
    decode_num_stages: int = 2


DEFAULT_PAGED_TILES = PagedTiles()


def _check_common(
    name: str,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    out: torch.Tensor,
) -> None:
    dev = q.device
    check_tensor(name, "q", q, shape=(None, None, None), dtypes=_FLOATS, device=dev)
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    check_tensor(name, "k_cache", k_cache, shape=(None, None, None, head_dim),
                 dtypes=(q.dtype, KV_FP8_DTYPE), device=dev)
    check_tensor(name, "v_cache", v_cache, shape=tuple(k_cache.shape), dtypes=(k_cache.dtype,),
                 device=dev)
    num_kv_heads = k_cache.shape[2]
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise KernelArgumentError(
            name, "k_cache", f"has {num_kv_heads} KV heads, which must divide q's {num_q_heads}"
        )
    check_tensor(name, "block_tables", block_tables, shape=(None, None), dtypes=(torch.int32,),
                 device=dev)
    check_tensor(name, "context_lens", context_lens, shape=(block_tables.shape[0],),
                 dtypes=(torch.int32,), device=dev)
    check_contiguous(name, "context_lens", context_lens)
    check_tensor(name, "out", out, shape=tuple(q.shape), dtypes=(q.dtype,), device=dev)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    *,
    tiles: PagedTiles = DEFAULT_PAGED_TILES,
) -> torch.Tensor:
    """Causal GQA attention of chunks of queries over paged KV (prefill, mixed, or decode).

    q [N, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks]
    int32; query_start_loc [B+1] int32 (non-decreasing, last == N); context_lens [B] int32
    (>= that sequence's q_len, and <= max_blocks * block_size); out [N, Hq, D]. Returns out.
    """
    name = "paged_attention"
    _check_common(name, q, k_cache, v_cache, block_tables, context_lens, out)
    num_seqs = block_tables.shape[0]
    check_tensor(name, "query_start_loc", query_start_loc, shape=(num_seqs + 1,),
                 dtypes=(torch.int32,), device=q.device)
    check_contiguous(name, "query_start_loc", query_start_loc)
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    require_triton(name, q.device)
    from kernels._paged_attention_triton import launch_paged_attention

    launch_paged_attention(
        q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
        query_start_loc=query_start_loc, context_lens=context_lens, scale=float(scale), out=out,
        block_m=tiles.block_m, block_n=tiles.block_n, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out


def paged_decode_workspace_bytes(
    num_seqs: int, num_q_heads: int, head_dim: int, num_splits: int
) -> int:
    """Bytes of ``workspace`` for ``paged_decode_attention`` with ``num_splits`` > 1 (else 0)."""
    if num_splits <= 1:
        return 0
    rows = num_seqs * num_q_heads * num_splits
    return rows * next_pow2(max(head_dim, 16)) * 4 + rows * 2 * 4


def default_decode_splits(num_seqs: int, num_kv_heads: int, max_context: int, sm_count: int) -> int:
    """Splits that give about two programs per SM, each over >= 512 tokens (1 = no split)."""
    programs = max(num_seqs * num_kv_heads, 1)
    want = cdiv(2 * sm_count, programs)
    return max(1, min(want, cdiv(max_context, 512), 64))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    *,
    num_splits: int = 1,
    workspace: torch.Tensor | None = None,
    tiles: PagedTiles = DEFAULT_PAGED_TILES,
) -> torch.Tensor:
    """Decode: q [B, Hq, D] (each sequence's last token) over its whole paged context.

    ``num_splits`` > 1 splits each context into that many ranges of
    cdiv(max_blocks * block_size, num_splits) tokens (more programs for small batches), which
    needs ``workspace`` (uint8, >= ``paged_decode_workspace_bytes``; allocated if None).
    ``default_decode_splits`` suggests a value. Returns out.
    """
    name = "paged_decode_attention"
    _check_common(name, q, k_cache, v_cache, block_tables, context_lens, out)
    num_seqs, num_q_heads, head_dim = q.shape
    if block_tables.shape[0] != num_seqs:
        raise KernelArgumentError(name, "block_tables", f"must have {num_seqs} rows (one per q)")
    if num_splits < 1:
        raise KernelArgumentError(name, "num_splits", f"must be >= 1, got {num_splits}")
    if num_seqs == 0:
        return out
    need = paged_decode_workspace_bytes(num_seqs, num_q_heads, head_dim, num_splits)
    if need and workspace is None:
        workspace = torch.empty(need, dtype=torch.uint8, device=q.device)
    if need:
        assert workspace is not None
        check_tensor(name, "workspace", workspace, shape=(None,), dtypes=(torch.uint8,),
                     device=q.device)
        check_contiguous(name, "workspace", workspace)
        if workspace.numel() < need:
            raise KernelArgumentError(name, "workspace", f"holds {workspace.numel()} bytes, needs {need}")
        rows = num_seqs * num_q_heads * num_splits
        n_acc = rows * next_pow2(max(head_dim, 16)) * 4
        part_acc = workspace[:n_acc].view(torch.float32)
        part_ml = workspace[n_acc:need].view(torch.float32)
    else:
        part_acc = part_ml = out  # never touched without splits
    require_triton(name, q.device)
    from kernels._paged_attention_triton import launch_paged_decode

    max_tokens = block_tables.shape[1] * k_cache.shape[1]
    per_split = cdiv(cdiv(max(max_tokens, 1), num_splits), tiles.decode_block_n) * tiles.decode_block_n
    launch_paged_decode(
        q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
        context_lens=context_lens, scale=float(scale), out=out, part_acc=part_acc,
        part_ml=part_ml, num_splits=num_splits, tokens_per_split=per_split,
        block_n=tiles.decode_block_n, num_warps=tiles.decode_num_warps,
        num_stages=tiles.decode_num_stages,
    )
    return out
