"""Triton kernel of ``kernels.sinkhorn``: one program per token, the matrix in registers.
Nothing allocates here."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton_support import next_pow2


@triton.jit(do_not_specialize=["iters"])
def _sinkhorn_kernel(x_ptr, out_ptr, stride_xn, stride_xr, stride_on, stride_or, m, iters, eps,
                     BLOCK: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BLOCK)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (rows < m) & (cols < m)
    x = tl.load(x_ptr + tok * stride_xn + rows * stride_xr + cols, mask=mask, other=float("-inf"))
    x = x - tl.max(x, axis=1)[:, None]
    e = tl.where(mask, tl.exp(x), 0.0)
    c = tl.where(mask, e / tl.sum(e, axis=1)[:, None] + eps, 0.0)
    c = c / (tl.sum(c, axis=0)[None, :] + eps)
    for _ in range(iters - 1):
        c = c / (tl.sum(c, axis=1)[:, None] + eps)
        c = c / (tl.sum(c, axis=0)[None, :] + eps)
    tl.store(out_ptr + tok * stride_on + rows * stride_or + cols, c, mask=mask)


def launch_sinkhorn(logits: torch.Tensor, iters: int, eps: float, out: torch.Tensor) -> None:
    n, m, _ = logits.shape
    _sinkhorn_kernel[(n,)](
        logits, out, logits.stride(0), logits.stride(1), out.stride(0), out.stride(1), m, iters,
        eps, BLOCK=max(2, next_pow2(m)), num_warps=1,
    )
