"""DeepSeek-V4's mHC stream passes as single kernels: the merge after a block (``post * out +
comb^T @ streams``), the collapse before one (``sum_j pre_j * stream_j``) and the mixing
weights that steer both (``linear(rms_norm(streams), fn)``). In PyTorch the merge is a batched
4 x 4 matmul per token that cuBLAS runs at a few percent of bandwidth, the collapse
materialises an fp32 ``[N, m, D]`` product and the mixes an fp32 copy of the streams
(256 MiB at a 4096-token chunk of V4-Flash); here each reads the streams once and writes its
output once. ``kernels.hc_streams_ref`` is the specification; no scratch, all write into
``out``.
"""

from __future__ import annotations

import torch

from kernels._checks import check_contiguous, check_tensor
from kernels._triton_support import require_triton
from kernels.errors import KernelArgumentError

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_streams(name: str, streams: torch.Tensor) -> tuple[int, int, int]:
    check_tensor(name, "streams", streams, shape=(None, None, None), dtypes=_DTYPES,
                 device=streams.device)
    n, m, d = streams.shape
    if not 1 <= m <= 16:
        raise KernelArgumentError(name, "streams", f"must be [N, m, D] with 1 <= m <= 16, got {list(streams.shape)}")
    return n, m, d


def hc_merge(post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor,
             streams: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """post [N, m] fp32, comb [N, m, m] fp32, block_out [N, D], streams [N, m, D],
    out [N, m, D] (streams' dtype; must not alias streams) -> out (see ``hc_merge_ref``)."""
    name = "hc_merge"
    n, m, d = _check_streams(name, streams)
    dev = streams.device
    check_tensor(name, "post", post, shape=(n, m), dtypes=(torch.float32,), device=dev)
    check_tensor(name, "comb", comb, shape=(n, m, m), dtypes=(torch.float32,), device=dev)
    check_tensor(name, "block_out", block_out, shape=(n, d), dtypes=(streams.dtype,), device=dev)
    check_tensor(name, "out", out, shape=(n, m, d), dtypes=(streams.dtype,), device=dev)
    if out.data_ptr() == streams.data_ptr():
        raise KernelArgumentError(name, "out", "must not alias streams (other programs read them)")
    require_triton(name, dev)
    from kernels._hc_streams_triton import launch_hc_merge

    if n and d:
        launch_hc_merge(post, comb, block_out, streams, out)
    return out


def hc_collapse(pre: torch.Tensor, streams: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """pre [N, m] fp32, streams [N, m, D], out [N, D] (streams' dtype) -> out
    (see ``hc_collapse_ref``)."""
    name = "hc_collapse"
    n, m, d = _check_streams(name, streams)
    dev = streams.device
    check_tensor(name, "pre", pre, shape=(n, m), dtypes=(torch.float32,), device=dev)
    check_tensor(name, "out", out, shape=(n, d), dtypes=(streams.dtype,), device=dev)
    require_triton(name, dev)
    from kernels._hc_streams_triton import launch_hc_collapse

    if n and d:
        launch_hc_collapse(pre, streams, out)
    return out


def hc_mixes(streams: torch.Tensor, fn: torch.Tensor, eps: float, out: torch.Tensor) -> torch.Tensor:
    """streams [N, m, D] (rows may be strided, channels contiguous), fn [rows, m * D] fp32
    (contiguous), out [N, rows] fp32 -> out (see ``hc_mixes_ref``; the norm's scale is applied
    to the product, a linear map commuting with a per-row scale). For prefill chunks: tokens in
    tiles, the fp32 product on ``tl.dot``; decode's fused boundary is ``kernels.hc_decode``."""
    name = "hc_mixes"
    n, m, d = _check_streams(name, streams)
    dev = streams.device
    check_tensor(name, "fn", fn, shape=(None, m * d), dtypes=(torch.float32,), device=dev)
    check_contiguous(name, "fn", fn)
    rows = fn.shape[0]
    if not 1 <= rows <= 64:
        raise KernelArgumentError(name, "fn", f"must have 1..64 rows, got {rows}")
    check_tensor(name, "out", out, shape=(n, rows), dtypes=(torch.float32,), device=dev)
    require_triton(name, dev)
    from kernels._hc_streams_triton import launch_hc_mixes

    if n:
        launch_hc_mixes(streams, fn, eps, out)
    return out
