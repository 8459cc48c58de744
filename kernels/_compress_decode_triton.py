"""Triton kernels of ``kernels.compress_decode``: two launches per compressor and step.

1. ``_compress_window_kernel``, one program per (row, slice of the entry's channels): writes
   the token into its slot's open window, then (the gate softmax is per channel) the softmax-
   weighted sum over the window for its channels -> ``ent`` (unnormalised entry), and for CSA
   the Ca slice of the window it closes into its block. Pass 1 finds each channel's max and
   sum (online), pass 2 weights and sums with the weights and products rounded to the model
   dtype where the reference rounds them. The token's own window row is taken from registers,
   never read back, and only a slot's writer row stores (a graph's pad rows share row 0's slot).
2. ``_compress_entry_kernel``, one program per row: RMSNorm of the entry, RoPE at the window's
   first position (cos/sin from ``inv_freq``), and the flat pool row it goes to; given the pool
   (in the entry's dtype), the closing rows store the entry there too (no index_copy after).
Nothing allocates here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch_configs import launch_config
from kernels._pdl_triton import pdl_wait
from kernels._triton_support import cdiv, next_pow2, pdl_kwargs


@triton.jit
def _window_tile(i, cols, ok_c, slot, b0, tok_kv, tok_g, prev, has_prev, r, d, win,
                 bkv_ptr, bg_ptr, pb_ptr, okv_ptr, og_ptr,
                 s_bs, s_br, s_pb, s_os, s_or, OVERLAP: tl.constexpr):
    """Rows ``i`` of a row's window, channels ``cols`` -> (kv, gate + bias), fp32 [W, C]."""
    ok_i = i < win
    if OVERLAP:
        cur = ok_i & (i >= r)
        j = i - r
        off = d
    else:
        cur = ok_i
        j = i
        off = 0
    own = (j == b0)[:, None]
    ok = cur[:, None] & ok_c[None, :]
    rowp = slot * s_bs + j[:, None] * s_br + off + cols[None, :]
    kvt = tl.load(bkv_ptr + rowp, mask=ok & ~own, other=0.0).to(tl.float32)
    gt = tl.load(bg_ptr + rowp, mask=ok & ~own, other=0.0).to(tl.float32)
    kvt = tl.where(own, tok_kv[None, :], kvt)
    gt = tl.where(own, tok_g[None, :], gt)
    gt += tl.load(pb_ptr + j[:, None] * s_pb + off + cols[None, :], mask=ok, other=0.0)
    gt = tl.where(ok, gt, float("-inf"))
    if OVERLAP:
        okp = (ok_i & (i < r) & ((i * 0 + has_prev) > 0))[:, None] & ok_c[None, :]
        pp = prev * s_os + i[:, None] * s_or + cols[None, :]
        kvt = tl.where(okp, tl.load(okv_ptr + pp, mask=okp, other=0.0).to(tl.float32), kvt)
        gt = tl.where(okp, tl.load(og_ptr + pp, mask=okp, other=0.0), gt)
    return kvt, gt


@triton.jit
def _compress_window_kernel(kv_ptr, g_ptr, wr_ptr, slot_ptr, pos_ptr, tab_ptr, bkv_ptr, bg_ptr,
                            pb_ptr, okv_ptr, og_ptr, ent_ptr, r, d, win, block_size,
                            s_kv, s_g, s_tab, s_bs, s_br, s_pb, s_os, s_or, s_ent,
                            OVERLAP: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr,
                            PDL: tl.constexpr = 0):
    pdl_wait(PDL)  # before any memory access (kernels/NOTES.md)
    row = tl.program_id(0).to(tl.int64)
    wr = tl.load(wr_ptr + row)
    is_writer = wr == row
    slot = tl.load(slot_ptr + row)
    pos = tl.load(pos_ptr + row)
    b0 = pos % r
    e0 = pos // r
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok_c = cols < d
    # the writer rows' stores; (a vector comparison: the interpreter masks only with vectors)
    ok_w = ok_c & ((cols * 0 + wr) == row)
    # the token's projections (its writer's: identical bits wherever a slot is written twice)
    tok_kv = tl.load(kv_ptr + wr * s_kv + cols, mask=ok_c, other=0.0)
    tok_g = tl.load(g_ptr + wr * s_g + cols, mask=ok_c, other=0.0)
    dst = slot * s_bs + b0 * s_br + cols
    tl.store(bkv_ptr + dst, tok_kv.to(bkv_ptr.dtype.element_ty), mask=ok_w)
    tl.store(bg_ptr + dst, tok_g.to(bg_ptr.dtype.element_ty), mask=ok_w)
    prev = 0
    has_prev = (e0 > 0).to(tl.int32)
    if OVERLAP:
        ca_kv, ca_g = tok_kv, tok_g  # this token's Ca channels (the window's first series)
        tok_kv = tl.load(kv_ptr + wr * s_kv + d + cols, mask=ok_c, other=0.0)
        tok_g = tl.load(g_ptr + wr * s_g + d + cols, mask=ok_c, other=0.0)
        tl.store(bkv_ptr + dst + d, tok_kv.to(bkv_ptr.dtype.element_ty), mask=ok_w)
        tl.store(bg_ptr + dst + d, tok_g.to(bg_ptr.dtype.element_ty), mask=ok_w)
        prev_e = tl.maximum(e0 - 1, 0)
        prev = tl.load(tab_ptr + row * s_tab + prev_e * r // block_size)
    tok_kv = tok_kv.to(tl.float32)
    tok_g = tok_g.to(tl.float32)
    mx = tl.full((BLOCK_C,), -1e30, tl.float32)
    den = tl.zeros((BLOCK_C,), tl.float32)
    for w0 in range(0, win, BLOCK_W):
        i = w0 + tl.arange(0, BLOCK_W)
        _, gt = _window_tile(i, cols, ok_c, slot, b0, tok_kv, tok_g, prev, has_prev, r, d, win,
                             bkv_ptr, bg_ptr, pb_ptr, okv_ptr, og_ptr, s_bs, s_br, s_pb, s_os,
                             s_or, OVERLAP)
        new = tl.maximum(mx, tl.max(gt, axis=0))
        den = den * tl.exp(mx - new) + tl.sum(tl.exp(gt - new[None, :]), axis=0)
        mx = new
    acc = tl.zeros((BLOCK_C,), tl.float32)
    dt = ent_ptr.dtype.element_ty
    for w0 in range(0, win, BLOCK_W):
        i = w0 + tl.arange(0, BLOCK_W)
        kvt, gt = _window_tile(i, cols, ok_c, slot, b0, tok_kv, tok_g, prev, has_prev, r, d, win,
                               bkv_ptr, bg_ptr, pb_ptr, okv_ptr, og_ptr, s_bs, s_br, s_pb, s_os,
                               s_or, OVERLAP)
        w = (tl.exp(gt - mx[None, :]) / den[None, :]).to(dt).to(tl.float32)
        acc += tl.sum((kvt * w).to(dt).to(tl.float32), axis=0)
    tl.store(ent_ptr + row * s_ent + cols, acc.to(dt), mask=ok_c)
    if OVERLAP:  # noqa: SIM102 (a compile-time branch around a run-time one: Triton keeps them apart)
        if (b0 == r - 1) & is_writer:
            # the closed window's Ca slice into its block, for the next window's overlap; every
            # read of the previous slice (possibly the same block) is done first
            tl.debug_barrier()
            own = tl.load(tab_ptr + row * s_tab + e0 * r // block_size)
            ca_kv32 = ca_kv.to(tl.float32)  # new names: a run-time branch may not retype
            ca_g32 = ca_g.to(tl.float32)
            for w0 in range(0, r, BLOCK_W):
                i = w0 + tl.arange(0, BLOCK_W)
                mine = (i == b0)[:, None]
                ok = (i < r)[:, None] & ok_c[None, :]
                src = slot * s_bs + i[:, None] * s_br + cols[None, :]
                kvt = tl.load(bkv_ptr + src, mask=ok & ~mine, other=0.0).to(tl.float32)
                gt = tl.load(bg_ptr + src, mask=ok & ~mine, other=0.0).to(tl.float32)
                kvt = tl.where(mine, ca_kv32[None, :], kvt)
                gt = tl.where(mine, ca_g32[None, :], gt)
                gt += tl.load(pb_ptr + i[:, None] * s_pb + cols[None, :], mask=ok, other=0.0)
                o = own * s_os + i[:, None] * s_or + cols[None, :]
                tl.store(okv_ptr + o, kvt.to(okv_ptr.dtype.element_ty), mask=ok)
                tl.store(og_ptr + o, gt, mask=ok)


@triton.jit
def _compress_entry_kernel(ent_ptr, w_ptr, freq_ptr, wr_ptr, pos_ptr, tab_ptr, out_ptr, dst_ptr,
                           pool_ptr, r, d, half, per, eps, rope_scale, s_ent, s_tab, s_out,
                           s_pool, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                           POOL: tl.constexpr = False, PDL: tl.constexpr = 0):
    pdl_wait(PDL)  # before any memory access (kernels/NOTES.md)
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + row)
    e0 = pos // r
    cols = tl.arange(0, BLOCK_D)
    ok = cols < d
    dt = out_ptr.dtype.element_ty
    closing = (pos % r == r - 1) & (tl.load(wr_ptr + row) == row)
    entry_row = tl.load(tab_ptr + row * s_tab + e0 // per) * per + e0 % per
    # with POOL the closing rows also store the entry into its pool row (in a vector
    # comparison: the interpreter masks only with vectors)
    in_pool = (cols * 0 + closing.to(tl.int32)) != 0
    x = tl.load(ent_ptr + row * s_ent + cols, mask=ok, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / d + eps)
    y = (x * inv * tl.load(w_ptr + cols, mask=ok, other=0.0)).to(dt)
    nope = d - 2 * half
    tl.store(out_ptr + row * s_out + cols, y, mask=cols < nope)
    if POOL:
        tl.store(pool_ptr + entry_row * s_pool + cols, y, mask=(cols < nope) & in_pool)
    p = tl.arange(0, BLOCK_R)
    ok_p = p < half
    ev, od = nope + 2 * p, nope + 2 * p + 1
    x1 = tl.load(ent_ptr + row * s_ent + ev, mask=ok_p, other=0.0).to(tl.float32)
    x2 = tl.load(ent_ptr + row * s_ent + od, mask=ok_p, other=0.0).to(tl.float32)
    x1 = (x1 * inv * tl.load(w_ptr + ev, mask=ok_p, other=0.0)).to(dt).to(tl.float32)
    x2 = (x2 * inv * tl.load(w_ptr + od, mask=ok_p, other=0.0)).to(dt).to(tl.float32)
    f = (e0 * r).to(tl.float32) * tl.load(freq_ptr + p, mask=ok_p, other=0.0)
    c = (tl.cos(f) * rope_scale).to(dt).to(tl.float32)
    s = (tl.sin(f) * rope_scale).to(dt).to(tl.float32)
    y1 = (x1 * c - x2 * s).to(dt)
    y2 = (x2 * c + x1 * s).to(dt)
    tl.store(out_ptr + row * s_out + ev, y1, mask=ok_p)
    tl.store(out_ptr + row * s_out + od, y2, mask=ok_p)
    if POOL:
        pool_p = (p * 0 + closing.to(tl.int32)) != 0
        tl.store(pool_ptr + entry_row * s_pool + ev, y1, mask=ok_p & pool_p)
        tl.store(pool_ptr + entry_row * s_pool + od, y2, mask=ok_p & pool_p)
    tl.store(dst_ptr + row, tl.where(closing, entry_row, 0))


def launch_compress_decode(kv: torch.Tensor, gate: torch.Tensor, writer: torch.Tensor,
                           slots: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor,
                           buf_kv: torch.Tensor, buf_gate: torch.Tensor,
                           position_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                           inv_freq: torch.Tensor, rope_scale: float, block_size: int,
                           ov_kv: torch.Tensor | None, ov_gate: torch.Tensor | None,
                           ent: torch.Tensor, out: torch.Tensor, dst: torch.Tensor,
                           pool: torch.Tensor | None = None) -> None:
    n = kv.shape[0]
    r = buf_kv.shape[1]
    overlap = ov_kv is not None
    d = out.shape[1]
    win = 2 * r if overlap else r
    okv = ov_kv if ov_kv is not None else buf_kv
    og = ov_gate if ov_gate is not None else buf_gate
    pdl = pdl_kwargs(kv.device)
    wc = launch_config("compress_window", n, win)  # channels a program, window rows a loop step
    _compress_window_kernel[(n, cdiv(d, wc["BLOCK_C"]))](
        kv, gate, writer, slots, positions, tables, buf_kv, buf_gate, position_bias, okv, og,
        ent, r, d, win, block_size, kv.stride(0), gate.stride(0), tables.stride(0),
        buf_kv.stride(0), buf_kv.stride(1), position_bias.stride(0), okv.stride(0),
        okv.stride(1), ent.stride(0), OVERLAP=overlap, BLOCK_C=wc["BLOCK_C"],
        BLOCK_W=min(wc["BLOCK_W"], max(2, next_pow2(win))), num_warps=wc["num_warps"], **pdl,
    )
    half = inv_freq.shape[0]
    _compress_entry_kernel[(n,)](
        ent, norm_weight, inv_freq, writer, positions, tables, out, dst,
        out if pool is None else pool, r, d, half, block_size // r, eps, rope_scale,
        ent.stride(0), tables.stride(0), out.stride(0), 0 if pool is None else pool.stride(0),
        BLOCK_D=next_pow2(d), BLOCK_R=max(2, next_pow2(half)), POOL=pool is not None, **pdl,
        num_warps=launch_config("compress_entry", n, win)["num_warps"],
    )
