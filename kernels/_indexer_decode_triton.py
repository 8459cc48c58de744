"""Triton kernel of ``kernels.indexer_decode``: one program per (row, tile of entries); the row's
queries ([H, D], 64 x 128 at V4-Flash) against the tile's keys gathered through the block table
as one dot, ReLU, head-weighted sum and the visibility mask in registers. Nothing allocates."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._indexer_triton import _unpack
from kernels._launch_configs import launch_config
from kernels._pdl_triton import pdl_wait
from kernels._triton_support import cdiv, interpreting, next_pow2, pdl_kwargs

INDEXER_DECODE_BLOCK_T = 64  # entries per program


@triton.jit
def _indexer_decode_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, tab_ptr, end_ptr, out_ptr, h, d, first,
                           num, per, s_qb, s_qh, s_wb, s_k, s_tab, s_ob, F32: tl.constexpr,
                           BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
                           HAS_K_SCALE: tl.constexpr = 0, PDL: tl.constexpr = 0):
    pdl_wait(PDL)  # before any memory access (kernels/NOTES.md)
    row = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok_t = t < num
    e = first + t
    end = tl.load(end_ptr + row)
    if first + tl.program_id(1) * BLOCK_T < end:
        blk = tl.load(tab_ptr + row * s_tab + e // per, mask=ok_t, other=0)
        kr = blk * per + e % per
        hh = tl.arange(0, BLOCK_H)
        dd = tl.arange(0, BLOCK_D)
        ok_d = dd < d
        q = tl.load(q_ptr + row * s_qb + hh[:, None] * s_qh + dd[None, :],
                    mask=(hh < h)[:, None] & ok_d[None, :], other=0.0)
        k = tl.load(k_ptr + kr[:, None] * s_k + dd[None, :], mask=ok_t[:, None] & ok_d[None, :],
                    other=0.0)
        if HAS_K_SCALE:  # FP8 keys: dequantised in fp32 by their row's scale, scored in fp32
            ks = tl.load(ks_ptr + kr, mask=ok_t, other=0.0)
            kf = k.to(tl.float32) * ks[:, None]
            s = tl.dot(q.to(tl.float32), tl.trans(kf), input_precision="ieee")
        elif F32:  # fp32 inputs, and the interpreter (whose bf16 dot is not exact)
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:  # bf16 x bf16 products are exact in the fp32 accumulator
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        w = tl.load(w_ptr + row * s_wb + hh, mask=hh < h, other=0.0)
        sc = tl.sum(tl.maximum(s, 0.0) * w[:, None], axis=0)  # [T]
        tl.store(out_ptr + row * s_ob + t, tl.where(e < end, sc, float("-inf")), mask=ok_t)
    else:  # a tile wholly past the row's closed entries (a short sequence in a wide table)
        tl.store(out_ptr + row * s_ob + t, tl.full([BLOCK_T], float("-inf"), tl.float32),
                 mask=ok_t)


def launch_indexer_decode(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                          tables: torch.Tensor, kv_end: torch.Tensor, first: int, num: int,
                          per_block: int, out: torch.Tensor,
                          key_scale: torch.Tensor | None = None) -> None:
    b, h, d = q.shape
    _indexer_decode_kernel[(b, cdiv(num, INDEXER_DECODE_BLOCK_T))](
        q, weights, keys, key_scale if key_scale is not None else weights, tables, kv_end, out,
        h, d, first, num, per_block,
        q.stride(0), q.stride(1), weights.stride(0), keys.stride(0), tables.stride(0),
        out.stride(0), F32=q.dtype == torch.float32 or interpreting(),
        BLOCK_H=max(16, next_pow2(h)), BLOCK_D=max(16, next_pow2(d)),
        BLOCK_T=INDEXER_DECODE_BLOCK_T, HAS_K_SCALE=key_scale is not None, num_warps=8,
        **pdl_kwargs(q.device),
    )


@triton.jit
def _topk_rows_finalize_kernel(best_ptr, tab_ptr, out_ptr, topk, per, s_tab, s_o,
                               KP: tl.constexpr, PDL: tl.constexpr = 0):
    """The running best of a row -> the pool rows of its entries (``table[e // per] * per + e
    % per``), int32, -1 past the visible ones: what the sparse attention takes as indices."""
    pdl_wait(PDL)  # before any memory access (kernels/NOTES.md)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, KP)
    score, e = _unpack(tl.load(best_ptr + row * KP + offs))
    valid = (score > float("-inf")) & (offs < topk)
    blk = tl.load(tab_ptr + row * s_tab + e // per, mask=valid, other=0)
    tl.store(out_ptr + row * s_o + offs, tl.where(valid, blk * per + e % per, -1).to(tl.int32),
             mask=offs < topk)


def launch_indexer_decode_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                               tables: torch.Tensor, kv_end: torch.Tensor, per_block: int,
                               num_entries: int, topk: int, kp: int, scores: torch.Tensor,
                               best: torch.Tensor, cand: torch.Tensor, out_scores: torch.Tensor,
                               out_indices: torch.Tensor, parts: int = 1,
                               combined: torch.Tensor | None = None,
                               key_scale: torch.Tensor | None = None) -> None:
    """Tiles of ``scores.shape[1]`` entries: each scored (``_indexer_decode_kernel``) then merged
    into the row's running best (the prefill indexer's ``_topk_merge_kernel``, which reads only
    the row's visible entries), by ``parts`` programs a row, each over its slice of the tile
    into its own best (``best`` / ``cand`` hold ``parts`` of them a row), combined into
    ``combined`` at the end; buffers carved by ``kernels.indexer_decode``."""
    from kernels._indexer_triton import (
        _topk_combine_kernel,
        _topk_finalize_kernel,
        _topk_init_kernel,
        _topk_merge_kernel,
    )

    b = q.shape[0]
    tile = scores.shape[1]
    pdl = pdl_kwargs(q.device)
    log_kp = kp.bit_length() - 1
    _topk_init_kernel[(b * parts,)](best, KP=kp, **pdl)
    for first in range(0, num_entries, tile):
        num = min(tile, num_entries - first)
        launch_indexer_decode(q, weights, keys, tables, kv_end, first, num, per_block, scores,
                              key_scale)
        _topk_merge_kernel[(b * parts,)](scores, kv_end, best, cand, first, num, topk,
                                         scores.stride(0), KP=kp, LOG_KP=log_kp, PARTS=parts,
                                         **pdl,
                                         num_warps=launch_config("topk_merge", b)["num_warps"])
    if parts > 1:
        assert combined is not None
        _topk_combine_kernel[(b,)](best, combined, KP=kp, LOG_KP=log_kp, PARTS=parts, **pdl,
                                   num_warps=launch_config("topk_merge", b)["num_warps"])
        best = combined
    if out_indices.dtype == torch.int32:  # pool rows for the attention
        _topk_rows_finalize_kernel[(b,)](best, tables, out_indices, topk, per_block,
                                         tables.stride(0), out_indices.stride(0), KP=kp, **pdl)
        return
    _topk_finalize_kernel[(b,)](best, out_scores, out_indices, topk, out_scores.stride(0),
                                out_indices.stride(0), KP=kp)
