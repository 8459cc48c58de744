"""The prefill form of the block-scaled FP8 linear: ``y = quant(x) @ dequant(W)^T`` with the
activations quantized to e4m3 per 1 x 128 group and an FP8 x FP8 tensor-core product.

Many rows (a prefill chunk) make the weight-only kernel (``kernels.fp8_linear``) compute bound
on decoding weight tiles to bf16 and on bf16 MMA; here the weight bytes go to the MMA as they
are stored, at twice bf16's rate. Few rows (decode) stay on the weight-only kernel: quantizing
the activations would only add a launch and rounding there. ``W8A8_MIN_ROWS`` is the switch.
The quantized activations and their scales are scratch carved from a caller-given uint8 buffer
(the engine's Workspace; ``fp8_w8a8_scratch_bytes``), so nothing allocates.
``kernels.fp8_w8a8_ref`` is the specification.
"""

from __future__ import annotations

import torch

from kernels._checks import check_tensor
from kernels._triton_support import interpreting, require_triton
from kernels.errors import KernelArgumentError

W8A8_MIN_ROWS = 128  # below this the weight-only kernel is used (decode, small batches)
GROUP = 128  # the activation group along K: DeepSeek's weight K block
AMAX_FLOOR = 1e-10  # an all-zero group's amax (kernels.fp8_w8a8_ref uses the same)
_ALIGN = 256
_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_W_DTYPES = (torch.float8_e4m3fn, torch.uint8)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


# Narrower outputs than this stay weight-only. On the H200 at 4096 rows with today's 64 x 128
# tiles (2026-12-04) w8a8 was faster at every V4-Flash width: 1.16x at N 512 (kv), 1.45x at
# 1024 (q_a), 1.6-1.97x at 2048-32768 (at 128 x 128 tiles, 2026-12-03, it lost at 512 and
# 1024). Below 512 it was not measured.
W8A8_MIN_N = 512


def uses_w8a8(m: int, block: tuple[int, int], n: int | None = None) -> bool:
    """True when an ``m``-row product with weight blocks ``block`` (and ``n`` outputs a group,
    when given) takes the w8a8 path: many rows, a wide enough output, and a weight K block
    equal to the activation group (one scale pair a K-tile)."""
    return (m >= W8A8_MIN_ROWS and block[1] == GROUP
            and (n is None or n >= W8A8_MIN_N))


def fp8_w8a8_scratch_bytes(m: int, k: int, groups: int = 1) -> int:
    """Scratch of one w8a8 product of ``m`` rows of ``groups`` x ``k`` inputs (``groups`` > 1:
    a block-diagonal weight of ``k`` inputs a group): the codes (m x groups x k B) and one fp32
    scale per row, group and 128 inputs, 256-B aligned each."""
    return _aligned(m * groups * k) + _aligned(m * groups * -(-k // GROUP) * 4)


def _tiles(m: int, dev: torch.device, n: int, k: int) -> tuple[int, int, int, int, int]:
    """Tiles of an ``m``-row product with ``n`` outputs (all groups) over ``k`` inputs."""
    if interpreting() or dev.type != "cuda":
        return 32, 32, 4, 4, 1
    # 64 x 128 x 128 FP8 tiles, 4 warps: 24 KiB of operands a stage. The fastest of the tiles
    # measured on the H200 for every V4-Flash projection at 4096 rows (1.61-1.95x weight-only,
    # against 1.38-1.67x for 128 x 128 with 8 warps; lab/results/notebook.md). Four stages fit
    # Hopper's 228 KiB of shared memory, three the ~100 KiB of SM120 / SM89 parts. Since the
    # kernel's K masks and scale promotion were cut (2026-12-06, H100, the old and new kernel
    # alike), 128 x 128 with 8 warps wins where the grid is small: 1,024 outputs or fewer (q_a
    # 0.154 -> 0.095 ms, kv 0.117 -> 0.089 at 4096 rows) or K of 2,048 or less (the shared
    # expert's down 0.181 -> 0.150; q_b and the indexer's q_b within a few percent).
    if n <= 1024 or k <= 2048:
        return 128, 128, 8, 8, 3
    stages = 4 if torch.cuda.get_device_capability(dev)[0] in (9, 10) else 3
    return 64, 128, 8, 4, stages


def fp8_act_quant(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> None:
    """x [M, G, K] (rows strided, last dim contiguous) -> q [M, G, K] uint8 e4m3 codes and
    s [M, G, ceil(K / 128)] fp32 scales, both contiguous (written in place)."""
    name = "fp8_act_quant"
    check_tensor(name, "x", x, shape=(None, None, None), dtypes=_ACT_DTYPES, device=x.device)
    m, groups, k = x.shape
    check_tensor(name, "q", q, shape=(m, groups, k), dtypes=(torch.uint8,), device=x.device)
    check_tensor(name, "s", s, shape=(m, groups, -(-k // GROUP)), dtypes=(torch.float32,),
                 device=x.device)
    for arg, t in (("x", x), ("q", q), ("s", s)):
        if t.numel() and t.stride(-1) != 1:
            raise KernelArgumentError(name, arg, f"last dim must be contiguous, got {t.stride()}")
    if not (q.is_contiguous() and s.is_contiguous()):
        raise KernelArgumentError(name, "q", "q and s must be contiguous")
    require_triton(name, x.device)
    from kernels._fp8_w8a8_triton import launch_act_quant

    if m:
        launch_act_quant(x, q, s, GROUP, AMAX_FLOOR)


def fp8_linear_w8a8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                    out: torch.Tensor, scratch: torch.Tensor,
                    block: tuple[int, int] = (128, 128),
                    tiles: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K]; weight [N, K] e4m3 (or its bits); scale fp32 [ceil(N/bn), ceil(K/128)];
    out [M, N]; scratch uint8 of >= ``fp8_w8a8_scratch_bytes(M, K)`` -> out. ``tiles``:
    (BLOCK_M, BLOCK_N, GROUP_M, warps, stages) instead of the built-in choice (benchmarks)."""
    check_tensor("fp8_linear_w8a8", "x", x, shape=(None, None), dtypes=_ACT_DTYPES,
                 device=x.device)
    _w8a8("fp8_linear_w8a8", x.unsqueeze(1), weight, scale, out, scratch, block, tiles)
    return out


def fp8_grouped_linear_w8a8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                            out: torch.Tensor, scratch: torch.Tensor,
                            block: tuple[int, int] = (128, 128),
                            tiles: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """Block-diagonal form (``kernels.fp8_linear.fp8_grouped_linear``): x [M, G, K]; weight
    [G * N, K]; out [M, G * N]; scratch of >= ``fp8_w8a8_scratch_bytes(M, K, G)`` bytes."""
    check_tensor("fp8_grouped_linear_w8a8", "x", x, shape=(None, None, None),
                 dtypes=_ACT_DTYPES, device=x.device)
    _w8a8("fp8_grouped_linear_w8a8", x, weight, scale, out, scratch, block, tiles)
    return out


def _w8a8(name: str, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
          out: torch.Tensor, scratch: torch.Tensor, block: tuple[int, int],
          tiles: tuple[int, int, int, int, int] | None) -> None:
    dev = x.device
    m, groups, k = x.shape
    check_tensor(name, "weight", weight, shape=(None, k), dtypes=_W_DTYPES, device=dev)
    if weight.shape[0] % groups:
        raise KernelArgumentError(name, "weight", f"must be [G * N, K] with G = {groups}, got "
                                  f"{list(weight.shape)}")
    if block[1] != GROUP or block[0] <= 0:
        raise KernelArgumentError(name, "block", f"K block must be {GROUP} (the activation "
                                  f"group), got {block}")
    if weight.stride(0) != k:
        raise KernelArgumentError(name, "weight", f"must be contiguous, got strides {weight.stride()}")
    nkb = -(-k // GROUP)
    check_tensor(name, "scale", scale, shape=(-(-weight.shape[0] // block[0]), nkb),
                 dtypes=(torch.float32,), device=dev)
    check_tensor(name, "out", out, shape=(m, weight.shape[0]), dtypes=_ACT_DTYPES, device=dev)
    if out.stride(-1) != 1:
        raise KernelArgumentError(name, "out", f"last dim must be contiguous, got {out.stride()}")
    need = fp8_w8a8_scratch_bytes(m, k, groups)
    if scratch.dtype != torch.uint8 or scratch.dim() != 1 or scratch.numel() < need \
            or scratch.device != dev:
        raise KernelArgumentError(name, "scratch", f"must be 1-D uint8 on {dev} with >= {need} "
                                  f"bytes, got {scratch.dtype} x {scratch.numel()}")
    require_triton(name, dev)
    if not m:
        return
    from kernels._fp8_w8a8_triton import launch_fp8_w8a8

    q = scratch[: m * groups * k].view(m, groups, k)
    off = _aligned(m * groups * k)
    s = scratch[off: off + m * groups * nkb * 4].view(torch.float32).view(m, groups, nkb)
    fp8_act_quant(x, q, s)
    launch_fp8_w8a8(q, s, weight.view(torch.uint8), scale, out.view(m, groups, -1), block,
                    tiles or _tiles(m, dev, weight.shape[0], k))
