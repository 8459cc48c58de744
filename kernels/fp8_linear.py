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


_MIN_PROGRAMS = 264  # two per SM of an H200 (132 SMs): below that a decode GEMM idles SMs


def fp8_linear_tiles(m: int, n: int, block_k: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) the wrapper launches for ``m`` x ``n`` outputs:
    small M (decode) streams the weight, so BLOCK_N shrinks until the grid covers the SMs;
    BLOCK_K divides the scale block when it can, so one scale per row multiplies each K-tile's
    partial product."""
    bk = next((c for c in (128, 64, 32, 16) if block_k % c == 0), 32)
    if m > 32:
        return 64, 128, bk, 8
    bm = 16 if m <= 16 else 32
    bn = next((c for c in (64, 32) if -(-n // c) * -(-m // bm) >= _MIN_PROGRAMS), 16)
    return bm, bn, bk, 4


def fp8_gemv_tiles(m: int, n: int, block_k: int) -> tuple[int, int, int, int, int, int] | None:
    """(BLOCK_M, BLOCK_N, BLOCK_K, UNROLL, num_warps, num_stages) of the decode kernel for
    ``m`` <= 32 rows, or None (more rows, or a scale block no power-of-two K-tile divides).
    Decode streams the weight: 64-row N tiles when that still gives two waves of programs on
    an H200's 132 SMs, else 32-row tiles with two K-tiles a trip (H200 sweep,
    ``bench.kernel_quant_cases.sweep_quant_tiles``: N = 32768 -> 64/1, N = 4096 -> 32/2)."""
    bk = next((c for c in (128, 64, 32, 16) if block_k % c == 0), None)
    if m > 32 or bk is None:
        return None
    bm = 16 if m <= 16 else 32
    if -(-n // 64) >= 264:
        return bm, 64, bk, 1, 4, 3
    return bm, 32, bk, 2, 4, 3


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor,
               block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32, rows strided, last dim contiguous); weight [N, K] e4m3 (or its
    uint8 bits); scale fp32 [ceil(N/bn), ceil(K/bk)]; out [M, N] -> out."""
    check_tensor("fp8_linear", "x", x, shape=(None, None), dtypes=_ACT_DTYPES, device=x.device)
    check_tensor("fp8_linear", "out", out, shape=(x.shape[0], None), dtypes=_ACT_DTYPES,
                 device=x.device)
    _fp8_linear("fp8_linear", x.unsqueeze(1), weight, scale, out.unsqueeze(1), block)
    return out


def fp8_grouped_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                       out: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """Block-diagonal form (DeepSeek-V4's grouped output projection): x [M, G, K]; weight
    [G * N, K] (group g owns rows g*N..(g+1)*N; one scale grid over all of them, so a scale
    block may straddle two groups); out [M, G * N] -> out, ``out[:, g*N:(g+1)*N] = x[:, g] @
    dequant(weight[g*N:(g+1)*N])^T``."""
    name = "fp8_grouped_linear"
    check_tensor(name, "x", x, shape=(None, None, None), dtypes=_ACT_DTYPES, device=x.device)
    m, groups, _ = x.shape
    if weight.dim() != 2 or weight.shape[0] % groups:
        raise KernelArgumentError(name, "weight", f"must be [G * N, K] with G = {groups} "
                                  f"groups, got {list(weight.shape)}")
    check_tensor(name, "out", out, shape=(m, weight.shape[0]), dtypes=_ACT_DTYPES, device=x.device)
    _fp8_linear(name, x, weight, scale, out.view(m, groups, -1), block)
    return out


def _fp8_linear(name: str, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                out: torch.Tensor, block: tuple[int, int]) -> None:
    """x [M, G, K], out [M, G, N] (views checked by the caller)."""
    dev = x.device
    m, groups, k = x.shape
    check_tensor(name, "weight", weight, shape=(None, k), dtypes=_W_DTYPES, device=dev)
    n = weight.shape[0] // groups
    if block[0] <= 0 or block[1] <= 0:
        raise KernelArgumentError(name, "block", f"must be positive, got {block}")
    grid = (-(-(groups * n) // block[0]), -(-k // block[1]))
    check_tensor(name, "scale", scale, shape=grid, dtypes=(torch.float32,), device=dev)
    check_tensor(name, "out", out, shape=(m, groups, n), dtypes=_ACT_DTYPES, device=dev)
    if weight.stride(0) != k:
        raise KernelArgumentError(name, "weight", f"must be contiguous, got strides {weight.stride()}")
    require_triton(name, dev)
    from kernels._fp8_linear_triton import launch_fp8_gemv, launch_fp8_linear

    if not (m and n):
        return
    gemv = fp8_gemv_tiles(m, groups * n, block[1])
    if gemv is not None:
        launch_fp8_gemv(x, weight.view(torch.uint8), scale, out, block, gemv)
    else:
        launch_fp8_linear(x, weight.view(torch.uint8), scale, out, block,
                          fp8_linear_tiles(m, groups * n, block[1]))
