"""Triton kernel of ``kernels.rope_norm``: one program per (token, head) row, the whole row in
registers (D = 512 at V4-Flash). The rotated pairs are read a second time as even/odd lanes
(from cache) rather than shuffled in registers. Nothing allocates here."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch_configs import launch_config
from kernels._pdl_triton import pdl_wait
from kernels._triton_support import next_pow2, pdl_kwargs


@triton.jit
def _rope_norm_kernel(x_ptr, cos_ptr, sin_ptr, w_ptr, src_ptr, dst_ptr, out_ptr, d, half, eps,
                      stride_xn, stride_xh, stride_cn, stride_on, stride_oh,
                      NORM: tl.constexpr, WEIGHT: tl.constexpr, SRC: tl.constexpr,
                      DST: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                      PDL: tl.constexpr = 0):
    pdl_wait(PDL)  # before any memory access (kernels/NOTES.md)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    src = row
    dst = row
    if SRC:
        src = tl.load(src_ptr + row).to(tl.int64)
    if DST:
        dst = tl.load(dst_ptr + row).to(tl.int64)
    x_row = x_ptr + src * stride_xn + head * stride_xh
    o_row = out_ptr + dst * stride_on + head * stride_oh
    cols = tl.arange(0, BLOCK_D)
    ok = cols < d
    x = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
    inv = 1.0
    if NORM:
        inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / d + eps)
    nope = d - 2 * half
    y = x * inv
    if WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=ok, other=0.0)
    tl.store(o_row + cols, y.to(out_ptr.dtype.element_ty), mask=cols < nope)
    p = tl.arange(0, BLOCK_R)
    ok_p = p < half
    x1 = tl.load(x_row + nope + 2 * p, mask=ok_p, other=0.0).to(tl.float32) * inv
    x2 = tl.load(x_row + nope + 2 * p + 1, mask=ok_p, other=0.0).to(tl.float32) * inv
    if WEIGHT:
        x1 = x1 * tl.load(w_ptr + nope + 2 * p, mask=ok_p, other=0.0)
        x2 = x2 * tl.load(w_ptr + nope + 2 * p + 1, mask=ok_p, other=0.0)
    if NORM:  # the reference rounds the normed row before rotating it
        x1 = x1.to(out_ptr.dtype.element_ty).to(tl.float32)
        x2 = x2.to(out_ptr.dtype.element_ty).to(tl.float32)
    c = tl.load(cos_ptr + row * stride_cn + p, mask=ok_p, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + row * stride_cn + p, mask=ok_p, other=0.0).to(tl.float32)
    tl.store(o_row + nope + 2 * p, (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=ok_p)
    tl.store(o_row + nope + 2 * p + 1, (x2 * c + x1 * s).to(out_ptr.dtype.element_ty), mask=ok_p)


def launch_rope_norm(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor,
                     norm: bool, weight: torch.Tensor | None, eps: float,
                     src_rows: torch.Tensor | None, dst_rows: torch.Tensor | None) -> None:
    n, h, d = x.shape
    half = cos.shape[1]
    if half == 0:  # nothing rotates: an empty table may have no address; any valid one will do
        cos = sin = x
    _rope_norm_kernel[(n, h)](
        x, cos, sin, x if weight is None else weight, x if src_rows is None else src_rows,
        x if dst_rows is None else dst_rows, out, d, half, eps,
        x.stride(0), x.stride(1), cos.stride(0), out.stride(0), out.stride(1),
        NORM=norm, WEIGHT=weight is not None, SRC=src_rows is not None,
        DST=dst_rows is not None, BLOCK_D=next_pow2(d), BLOCK_R=max(2, next_pow2(half)),
        num_warps=launch_config("rope_norm", n, d)["num_warps"], **pdl_kwargs(x.device),
    )
