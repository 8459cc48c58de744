"""Block-scaled FP8 linear ``y = x @ dequant(W)^T`` with W kept in its checkpoint format.

W is e4m3 ``[N, K]`` with an fp32 scale per ``block = (bn, bk)`` tile, ``[ceil(N/bn),
ceil(K/bk)]`` (DeepSeek's 128 x 128 layout; N and K need not be multiples of the block).
Activations are fed as they are (bf16 on the GPU, fp32 on the CPU tier) and the weight is
decoded tile by tile inside the kernel, so the full-precision weight never exists in memory.
``kernels.fp8_linear_ref`` is the specification. No scratch: writes into ``out``.
"""

from __future__ import annotations

import torch

from kernels._checks import check_tensor
from kernels._triton_support import require_triton
from kernels.errors import KernelArgumentError

_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_W_DTYPES = (torch.float8_e4m3fn, torch.uint8)


def fp8_linear_tiles(m: int, block_k: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) the wrapper launches for ``m`` rows: small M
    (decode) streams the weight with narrow row tiles; BLOCK_K divides the scale block when it
    can, so one scale per row multiplies each K-tile's partial product."""
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    bk = next((c for c in (128, 64, 32, 16) if block_k % c == 0), 32)
    return bm, 64 if m <= 32 else 128, bk, 4 if m <= 32 else 8


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor,
               block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32, rows strided, last dim contiguous); weight [N, K] e4m3 (or its
    uint8 bits); scale fp32 [ceil(N/bn), ceil(K/bk)]; out [M, N] -> out."""
    name = "fp8_linear"
    dev = x.device
    check_tensor(name, "x", x, shape=(None, None), dtypes=_ACT_DTYPES, device=dev)
    m, k = x.shape
    check_tensor(name, "weight", weight, shape=(None, k), dtypes=_W_DTYPES, device=dev)
    n = weight.shape[0]
    if block[0] <= 0 or block[1] <= 0:
        raise KernelArgumentError(name, "block", f"must be positive, got {block}")
    grid = (-(-n // block[0]), -(-k // block[1]))
    check_tensor(name, "scale", scale, shape=grid, dtypes=(torch.float32,), device=dev)
    check_tensor(name, "out", out, shape=(m, n), dtypes=_ACT_DTYPES, device=dev)
    if weight.stride(0) != k:
        raise KernelArgumentError(name, "weight", f"must be contiguous, got strides {weight.stride()}")
    require_triton(name, dev)
    from kernels._fp8_linear_triton import launch_fp8_linear

    if m and n:
        launch_fp8_linear(x, weight.view(torch.uint8), scale, out, block,
                          fp8_linear_tiles(m, block[1]))
    return out
