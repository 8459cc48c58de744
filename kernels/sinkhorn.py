"""DeepSeek-V4's mHC Sinkhorn normalisation in one kernel: one program per token holds its
``m x m`` matrix in registers for every iteration. Unfused, each of the ~20 iterations is six
small PyTorch kernels per hyper-connection, which made up ~40% of a decode step's launches.
``kernels.sinkhorn_ref`` is the specification; no scratch, writes into ``out``.
"""

from __future__ import annotations

import torch

from kernels._checks import check_tensor
from kernels._triton_support import require_triton
from kernels.errors import KernelArgumentError


def sinkhorn(logits: torch.Tensor, iters: int, eps: float, out: torch.Tensor) -> torch.Tensor:
    """logits, out: [N, m, m] fp32 (m <= 16). -> out (see ``sinkhorn_ref``)."""
    name = "sinkhorn"
    dev = logits.device
    check_tensor(name, "logits", logits, shape=(None, None, None), dtypes=(torch.float32,),
                 device=dev)
    n, m, m2 = logits.shape
    if m != m2 or not 1 <= m <= 16:
        raise KernelArgumentError(name, "logits", f"must be [N, m, m] with m <= 16, got {list(logits.shape)}")
    check_tensor(name, "out", out, shape=(n, m, m), dtypes=(torch.float32,), device=dev)
    if iters < 1:
        raise KernelArgumentError(name, "iters", f"must be >= 1, got {iters}")
    require_triton(name, dev)
    from kernels._sinkhorn_triton import launch_sinkhorn

    if n:
        launch_sinkhorn(logits, iters, eps, out)
    return out
