"""Triton kernels of ``kernels.moe_decode``: one program per token for the routing (the E
scores in registers, top-k by k rounds of argmax), or the router's linear and the routing in
one launch (programs per (token, expert group), the token's last one routes), one per
(token, slice) for the SwiGLU. Values
are rounded to the model dtype wherever the reference's ops round. Nothing allocates here."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch_configs import launch_config
from kernels._pdl_triton import pdl_wait
from kernels._triton_support import cdiv, next_pow2, pdl_kwargs

SWIGLU_BLOCK = 1024  # channels per SwiGLU program


@triton.jit
def _route_row(lg_row, bias_ptr, hash_ptr, tok_ptr, w_ptr, idx_ptr, row, e, k, scaling, stride_h,
               dt: tl.constexpr, SCORING: tl.constexpr, HASH: tl.constexpr,
               BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """The routing of one row from its E logits at ``lg_row`` (read from L2: in the fused router
    other programs of this launch wrote them)."""
    ex = tl.arange(0, BLOCK_E)
    ok = ex < e
    x = tl.load(lg_row + ex, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    if SCORING == 0:  # sqrt(softplus), each op rounded as torch's in the model dtype
        sp = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x))).to(dt).to(tl.float32)
        sc = tl.sqrt(sp).to(dt).to(tl.float32)
    elif SCORING == 1:
        sc = tl.sigmoid(x).to(dt).to(tl.float32)
    else:
        z = tl.exp(tl.where(ok, x, float("-inf")) - tl.max(tl.where(ok, x, float("-inf")), axis=0))
        sc = (z / tl.sum(z, axis=0)).to(dt).to(tl.float32)
    kk = tl.arange(0, BLOCK_K)
    ok_k = kk < k
    if HASH:
        tok = tl.load(tok_ptr + row)
        picked = tl.load(hash_ptr + tok * stride_h + kk, mask=ok_k, other=0)
    else:
        biased = tl.where(ok, sc + tl.load(bias_ptr + ex, mask=ok, other=0.0), float("-inf"))
        picked = tl.zeros((BLOCK_K,), tl.int64)
        for j in range(0, k):
            best = tl.argmax(biased, axis=0)
            picked = tl.where(kk == j, best.to(tl.int64), picked)
            biased = tl.where(ex == best, float("-inf"), biased)
    # the picked experts' scores: a masked sum over the E lanes per pick
    w = tl.sum(tl.where(ex[None, :] == picked[:, None], sc[None, :], 0.0), axis=1)  # [K]
    w = tl.where(ok_k, w, 0.0)
    den = (tl.sum(w, axis=0).to(dt).to(tl.float32) + 1e-20).to(dt).to(tl.float32)
    w = ((w / den).to(dt).to(tl.float32) * scaling).to(dt).to(tl.float32)
    tl.store(w_ptr + row * k + kk, w, mask=ok_k)
    tl.store(idx_ptr + row * k + kk, picked, mask=ok_k)


@triton.jit
def _moe_route_kernel(lg_ptr, bias_ptr, hash_ptr, tok_ptr, w_ptr, idx_ptr, e, k, scaling,
                      stride_l, stride_h, SCORING: tl.constexpr, HASH: tl.constexpr,
                      BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_wait(PDL)  # before any memory access (kernels/NOTES.md)
    row = tl.program_id(0).to(tl.int64)
    _route_row(lg_ptr + row * stride_l, bias_ptr, hash_ptr, tok_ptr, w_ptr, idx_ptr, row, e, k,
               scaling, stride_h, lg_ptr.dtype.element_ty, SCORING, HASH, BLOCK_E, BLOCK_K)


@triton.jit
def _moe_router_kernel(x_ptr, gw_ptr, lg_ptr, sem_ptr, bias_ptr, hash_ptr, tok_ptr, w_ptr,
                       idx_ptr, e, hidden, k, scaling, stride_x, stride_gw, stride_l, stride_h,
                       SCORING: tl.constexpr, HASH: tl.constexpr, BLOCK_G: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                       PDL: tl.constexpr = 0):
    """The router's logits and the routing in one launch: program (row, g) computes the logits
    of experts [g * BLOCK_G, (g + 1) * BLOCK_G) of its row (fp32 sums, rounded to the model
    dtype as the router's linear rounds), stores them, and counts in on the row's counter; the
    row's last program routes it from the stored logits and puts the counter back to 0 (the
    split-K GEMVs' pattern, ``_fp8_linear_triton._last_slice_sum``)."""
    pdl_wait(PDL)  # before any memory access (kernels/NOTES.md)
    row = tl.program_id(0).to(tl.int64)
    ex = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    ok = ex < e
    dt = lg_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_G, BLOCK_H), tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        hh = h0 + tl.arange(0, BLOCK_H)
        ok_h = hh < hidden
        xv = tl.load(x_ptr + row * stride_x + hh, mask=ok_h, other=0.0).to(tl.float32)
        wv = tl.load(gw_ptr + ex[:, None] * stride_gw + hh[None, :],
                     mask=ok[:, None] & ok_h[None, :], other=0.0).to(tl.float32)
        acc += wv * xv[None, :]
    lg_row = lg_ptr + row * stride_l
    tl.store(lg_row + ex, tl.sum(acc, axis=1).to(dt), mask=ok)
    tl.debug_barrier()  # every thread's store before the counting atomic (release)
    count = tl.atomic_add(sem_ptr + row, 1, sem="acq_rel")
    if count == tl.num_programs(1) - 1:
        _route_row(lg_row, bias_ptr, hash_ptr, tok_ptr, w_ptr, idx_ptr, row, e, k, scaling,
                   stride_h, dt, SCORING, HASH, BLOCK_E, BLOCK_K)
        tl.atomic_xchg(sem_ptr + row, 0)


@triton.jit
def _clamped_swiglu_kernel(g_ptr, u_ptr, out_ptr, n, limit, stride_g, stride_u, stride_o,
                           BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_wait(PDL)  # before any memory access (kernels/NOTES.md)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    dt = out_ptr.dtype.element_ty
    g = tl.minimum(tl.load(g_ptr + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32), limit)
    u = tl.load(u_ptr + row * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (s * u).to(dt), mask=ok)


_SCORING_CODE = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}


def launch_moe_route(logits: torch.Tensor, top_k: int, scoring: str, scaling: float,
                     bias: torch.Tensor | None, hash_table: torch.Tensor | None,
                     token_ids: torch.Tensor | None, weights: torch.Tensor,
                     experts: torch.Tensor) -> None:
    n, e = logits.shape
    _moe_route_kernel[(n,)](
        logits, logits if bias is None else bias, experts if hash_table is None else hash_table,
        experts if token_ids is None else token_ids, weights, experts, e, top_k, scaling,
        logits.stride(0), 0 if hash_table is None else hash_table.stride(0),
        SCORING=_SCORING_CODE[scoring], HASH=hash_table is not None,
        BLOCK_E=max(2, next_pow2(e)), BLOCK_K=max(2, next_pow2(top_k)),
        num_warps=launch_config("moe_route", n)["num_warps"],
        **pdl_kwargs(logits.device),
    )


def launch_moe_router(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, scoring: str,
                      scaling: float, bias: torch.Tensor | None, hash_table: torch.Tensor | None,
                      token_ids: torch.Tensor | None, weights: torch.Tensor,
                      experts: torch.Tensor, logits: torch.Tensor,
                      semaphores: torch.Tensor) -> None:
    n, hidden = x.shape
    e = gate_weight.shape[0]
    cfg = launch_config("moe_router", n)
    group = min(cfg["BLOCK_G"], next_pow2(e))
    _moe_router_kernel[(n, cdiv(e, group))](
        x, gate_weight, logits, semaphores, logits if bias is None else bias,
        experts if hash_table is None else hash_table,
        experts if token_ids is None else token_ids, weights, experts, e, hidden, top_k, scaling,
        x.stride(0), gate_weight.stride(0), logits.stride(0),
        0 if hash_table is None else hash_table.stride(0),
        SCORING=_SCORING_CODE[scoring], HASH=hash_table is not None, BLOCK_G=group,
        BLOCK_H=min(cfg["BLOCK_H"], max(16, next_pow2(hidden))),
        BLOCK_E=max(2, next_pow2(e)), BLOCK_K=max(2, next_pow2(top_k)),
        num_warps=cfg["num_warps"], **pdl_kwargs(x.device),
    )


def launch_clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float,
                          out: torch.Tensor) -> None:
    n, c = gate.shape
    block = min(SWIGLU_BLOCK, next_pow2(c))
    _clamped_swiglu_kernel[(n, cdiv(c, block))](
        gate, up, out, c, limit, gate.stride(0), up.stride(0), out.stride(0), BLOCK=block,
        num_warps=4, **pdl_kwargs(gate.device),
    )
