"""DeepSeek-V4's per-head-row RMSNorm + interleaved partial RoPE as one kernel, for decode:
the queries (unweighted norm + rope, in place), the shared KV (weighted norm + rope written
straight into the window ring's rows), the indexer's queries and the attention output's
inverse rotation (rope only). Unfused, each is a cast, a norm and ~8 elementwise kernels, and
the KV write another handful. ``kernels.rope_norm_ref`` is the specification; writes into
``out`` (which may be ``x`` itself when no rows are remapped); no scratch.
"""

from __future__ import annotations

import torch

from kernels._checks import check_tensor
from kernels._triton_support import require_triton
from kernels.errors import KernelArgumentError

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def rope_norm(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, *,
              norm: bool, weight: torch.Tensor | None = None, eps: float = 1e-6,
              src_rows: torch.Tensor | None = None, dst_rows: torch.Tensor | None = None
              ) -> torch.Tensor:
    """See ``rope_norm_ref``. x: [N, H, D] or [N, D]; cos/sin [N, R/2] (x's dtype, 2R <= 2D);
    ``src_rows`` [N] int: row i of the result is made from x's row ``src_rows[i]``;
    ``dst_rows`` [N] int: it is written to ``out``'s row ``dst_rows[i]`` (default i; ``out``
    [M, H, D] or [M, D] in x's dtype, any M when remapped). Returns ``out``."""
    name = "rope_norm"
    dev = x.device
    check_tensor(name, "x", x, shape=(None,) * x.dim(), dtypes=_DTYPES, device=dev)
    if x.dim() not in (2, 3):
        raise KernelArgumentError(name, "x", f"must be [N, H, D] or [N, D], got {list(x.shape)}")
    n, d = x.shape[0], x.shape[-1]
    heads = x.shape[1] if x.dim() == 3 else 1
    check_tensor(name, "cos", cos, shape=(n, None), dtypes=(x.dtype,), device=dev)
    check_tensor(name, "sin", sin, shape=tuple(cos.shape), dtypes=(x.dtype,), device=dev)
    if cos.stride() != sin.stride():
        raise KernelArgumentError(name, "sin", f"must have cos's strides {cos.stride()}, got {sin.stride()}")
    if 2 * cos.shape[1] > d:
        raise KernelArgumentError(name, "cos", f"rotates {2 * cos.shape[1]} channels of a {d}-wide row")
    check_tensor(name, "out", out, shape=(None,) + tuple(x.shape[1:]), dtypes=(x.dtype,),
                 device=dev)
    if dst_rows is None and out.shape[0] != n:
        raise KernelArgumentError(name, "out", f"must have {n} rows without dst_rows, got {out.shape[0]}")
    if weight is not None:
        if not norm:
            raise KernelArgumentError(name, "weight", "is only used with norm=True")
        check_tensor(name, "weight", weight, shape=(d,), dtypes=(torch.float32,), device=dev)
    for arg, rows in (("src_rows", src_rows), ("dst_rows", dst_rows)):
        if rows is not None:
            check_tensor(name, arg, rows, shape=(n,), dtypes=(torch.int32, torch.int64), device=dev)
    if (src_rows is not None or dst_rows is not None) and out.data_ptr() == x.data_ptr():
        raise KernelArgumentError(name, "out", "must not alias x when rows are remapped")
    require_triton(name, dev)
    from kernels._rope_norm_triton import launch_rope_norm

    if n and d:
        launch_rope_norm(x.view(n, heads, d), cos, sin, out.view(out.shape[0], heads, d), norm,
                         weight, eps, src_rows, dst_rows)
    return out
