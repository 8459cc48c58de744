"""DeepSeek-V4's mHC work between two blocks of a decode step in three launches: the merge of
the previous block into the streams (optional), the next block's mixing weights (a projection
of the streams), its gates and Sinkhorn matrix, the collapse and the block's input RMSNorm.
Unfused that is ~25 small kernels per block boundary (casts, norms, a cuBLAS fp32 GEMV, the
gates, Sinkhorn, collapse), ~50 a layer. For decode (few tokens): a prefill chunk keeps the
separate passes, whose fp32 temporaries the planner knows. ``kernels.hc_decode_ref`` is the
specification. Writes into the caller's buffers; the partials' size is
:func:`hc_decode_partial_shape`.
"""

from __future__ import annotations

import torch

from kernels._checks import check_contiguous, check_positive, check_tensor
from kernels._triton_support import cdiv, require_triton
from kernels.errors import KernelArgumentError

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_F32 = (torch.float32,)
HC_MIX_SLICE = 64  # = _hc_decode_triton.HC_MIX_BLOCK_D (kept here so sizing needs no triton)


def hc_decode_partial_shape(n: int, m: int, d: int, head: bool = False) -> tuple[int, int, int]:
    """Shape of the fp32 ``partial`` scratch: [tokens, hidden slices, fn rows + 2] (the slice's
    dot products, its sum of squares, its collapse's sum of squares)."""
    rows = m if head else (2 + m) * m
    return (n, cdiv(d, HC_MIX_SLICE), rows + 2)


def hc_decode(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
    norm_weight: torch.Tensor, iters: int, hc_eps: float, norm_eps: float, *,
    partial: torch.Tensor, x: torch.Tensor, post: torch.Tensor | None = None,
    comb: torch.Tensor | None = None,
    merge: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    merged: torch.Tensor | None = None, head: bool = False,
    warps: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """See ``hc_decode_ref``. streams [N, m, D] (rows may be strided, channels contiguous); fn
    fp32 [(2+m)*m, m*D] (``head``: [m, m*D]); base, scale fp32; norm_weight fp32 [D].
    Outputs: x [N, D] (streams' dtype); post [N, m] and comb [N, m, m] fp32 (not for
    ``head``); ``merge`` = (post, comb, block_out) of the previous block, whose merged streams
    go to ``merged`` [N, m, D] (must not alias ``streams``). Returns the streams the next merge
    reads (``merged`` or ``streams``). ``warps``: num_warps of the three launches (mix, finish,
    norm; default ``_hc_decode_triton.hc_decode_warps``), for sweeps."""
    name = "hc_decode"
    check_tensor(name, "streams", streams, shape=(None, None, None), dtypes=_DTYPES,
                 device=streams.device)
    n, m, d = streams.shape
    dev = streams.device
    if not 1 <= m <= 16:
        raise KernelArgumentError(name, "streams", f"must be [N, m, D] with 1 <= m <= 16, got {list(streams.shape)}")
    check_positive(name, "iters", iters)
    rows = m if head else (2 + m) * m
    check_tensor(name, "fn", fn, shape=(rows, m * d), dtypes=_F32, device=dev)
    check_tensor(name, "base", base, shape=(rows,), dtypes=_F32, device=dev)
    check_tensor(name, "scale", scale, shape=(1 if head else 3,), dtypes=_F32, device=dev)
    check_tensor(name, "norm_weight", norm_weight, shape=(d,), dtypes=_F32, device=dev)
    check_tensor(name, "partial", partial, shape=hc_decode_partial_shape(n, m, d, head),
                 dtypes=_F32, device=dev)
    check_contiguous(name, "partial", partial)
    check_tensor(name, "x", x, shape=(n, d), dtypes=(streams.dtype,), device=dev)
    if not head:
        if post is None or comb is None:
            raise KernelArgumentError(name, "post", "post and comb are required unless head=True")
        check_tensor(name, "post", post, shape=(n, m), dtypes=_F32, device=dev)
        check_tensor(name, "comb", comb, shape=(n, m, m), dtypes=_F32, device=dev)
        check_contiguous(name, "post", post)
        check_contiguous(name, "comb", comb)
    if merge is not None:
        p0, c0, bo = merge
        check_tensor(name, "merge.post", p0, shape=(n, m), dtypes=_F32, device=dev)
        check_tensor(name, "merge.comb", c0, shape=(n, m, m), dtypes=_F32, device=dev)
        check_contiguous(name, "merge.post", p0)
        check_contiguous(name, "merge.comb", c0)
        check_tensor(name, "merge.block_out", bo, shape=(n, d), dtypes=(streams.dtype,), device=dev)
        if merged is None:
            raise KernelArgumentError(name, "merged", "is required with merge")
        check_tensor(name, "merged", merged, shape=(n, m, d), dtypes=(streams.dtype,), device=dev)
        if merged.data_ptr() == streams.data_ptr():
            raise KernelArgumentError(name, "merged", "must not alias streams (other programs read them)")
    if warps is not None and (len(warps) != 3 or any(w not in (1, 2, 4, 8) for w in warps)):
        raise KernelArgumentError(name, "warps", f"must be 3 of 1, 2, 4, 8, got {warps}")
    require_triton(name, dev)
    from kernels._hc_decode_triton import launch_hc_decode

    if n and d:
        launch_hc_decode(streams, fn, base, scale, norm_weight, iters, hc_eps, norm_eps, partial,
                         merge, merged, post, comb, x, head, warps)
    return streams if merge is None else merged  # type: ignore[return-value]
