"""Block-scaled FP8 linear ``y = x @ dequant(W)^T`` with W kept in its checkpoint format.

W is e4m3 ``[N, K]`` with an fp32 scale per ``block = (bn, bk)`` tile, ``[ceil(N/bn),
ceil(K/bk)]`` (DeepSeek's 128 x 128 layout; N and K need not be multiples of the block).
Activations are fed as they are (bf16 on the GPU, fp32 on the CPU tier) and the weight is
decoded tile by tile inside the kernel, so the full-precision weight never exists in memory.
``kernels.fp8_linear_ref`` is the specification. Writes into ``out``; the split-K decode
variant (:class:`Fp8GemvVariant`) also needs fp32 partials, ``fp8_linear_scratch_bytes`` of
them, from the caller's ``workspace`` (allocated here when None: benchmarks and tests only).
Given ``semaphores`` (:func:`gemv_semaphores`: zeroed int32 counters the caller keeps for the
life of the model, left zero by every launch), the last slice of each output tile sums the
partials itself; without them a second launch does (same sum, same order, same bits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._checks import check_tensor
from kernels._fp8_gemv_split import gemv_num_splits, gemv_semaphores_needed
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
    ``lab.bench.kernel_quant_cases.sweep_quant_tiles``: N = 32768 -> 64/1, N = 4096 -> 32/2)."""
    bk = next((c for c in (128, 64, 32, 16) if block_k % c == 0), None)
    if m > 32 or bk is None:
        return None
    bm = 16 if m <= 16 else 32
    if -(-n // 64) >= 264:
        return bm, 64, bk, 1, 4, 3
    return bm, 32, bk, 2, 4, 3


@dataclass(frozen=True)
class Fp8GemvVariant:
    """How the decode (M <= 32) kernel runs. ``tiles``: (BLOCK_M, BLOCK_N, BLOCK_K, UNROLL,
    num_warps, num_stages), BLOCK_K dividing the scale block's K; ``split``: K cut into up to
    this many slices of whole K-tiles, each slice's fp32 partial written to scratch and a
    second launch summing them in a fixed order (deterministic; more programs, shorter K loops);
    ``form``: "dot" (an MMA over a [BLOCK_N, BLOCK_M] tile) or "sum" (one row a program, a
    broadcast multiply and one reduction: BLOCK_N 4-16 for many programs at M = 1)."""

    tiles: tuple[int, int, int, int, int, int]
    split: int = 1
    form: str = "dot"

    def __post_init__(self) -> None:
        assert self.split >= 1 and self.form in ("dot", "sum"), self


_SPLIT_PROGRAMS = 512  # split-K until the grid holds this many programs (~4 an H200 SM)
_SPLIT_MAX = 8
_SPLIT_MIN_K_TILES = 4  # a slice keeps at least this many K-tiles


def fp8_gemv_variant(m: int, n: int, k: int, block_k: int) -> Fp8GemvVariant | None:
    """The decode variant ``fp8_linear`` launches for ``m`` x ``n`` outputs over ``k``, or None
    (the tiled kernel). The one place the choice is made. Where 64-row N tiles leave fewer
    than ``_SPLIT_PROGRAMS`` programs and K is long, K is split (up to 8 slices of at least 4
    K-tiles each) so the weight streams through more SMs at once. H200 sweep
    (``python -m lab.bench.quant_decode_sweep``, lab/results/quant_decode_sweep_h200.json): at V4-Flash's
    shapes this rule picks the best or within 15% of the best variant, 1.3-2.1x over the
    unsplit kernel, and leaves N = 32768 x K = 1024 (already 512 programs) unsplit."""
    tiles = fp8_gemv_tiles(m, n, block_k)
    if tiles is None:
        return None
    bm, _, bk = tiles[:3]
    n_tiles, k_tiles = -(-n // 64), -(-k // bk)
    split = 1
    while (split < _SPLIT_MAX and n_tiles * split < _SPLIT_PROGRAMS
           and k_tiles // (2 * split) >= _SPLIT_MIN_K_TILES):
        split *= 2
    if split == 1:
        return Fp8GemvVariant(tiles)
    return Fp8GemvVariant((bm, 64, bk, 1, 4, 3), split, "dot")


GEMV_SEMAPHORES = 4096  # counters one model keeps: enough for any split GEMV (< 512 tiles)
SERIAL_SPLIT_REDUCE = True  # False: the two-launch reduce even where semaphores are given (benches)


def gemv_semaphores(device: torch.device | str) -> torch.Tensor:
    """The zeroed int32 counters a model hands to every split-K GEMV (``GEMV_SEMAPHORES`` of
    them, 16 KiB). Launches on one stream share them: each launch puts its counters back to 0
    before it ends."""
    return torch.zeros(GEMV_SEMAPHORES, dtype=torch.int32, device=device)


def fp8_linear_scratch_bytes(m: int, n: int, k: int, block: tuple[int, int] = (128, 128),
                             variant: Fp8GemvVariant | None = None) -> int:
    """Workspace bytes ``fp8_linear`` / ``fp8_grouped_linear`` need at ``m`` rows, ``n``
    outputs (all groups) and ``k`` inputs (per group): the split-K partials, slices x m x n x
    4 B, zero without split-K. ``variant`` None: the default choice."""
    variant = variant or fp8_gemv_variant(m, n, k, block[1])
    if variant is None or variant.split == 1:
        return 0
    slices = gemv_num_splits(k, variant.tiles[2], variant.split)
    return 0 if slices == 1 else slices * m * n * 4


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor,
               block: tuple[int, int] = (128, 128), *, workspace: torch.Tensor | None = None,
               gemv: Fp8GemvVariant | None = None,
               semaphores: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32, rows strided, last dim contiguous); weight [N, K] e4m3 (or its
    uint8 bits); scale fp32 [ceil(N/bn), ceil(K/bk)]; out [M, N] -> out. ``workspace``: uint8
    of at least ``fp8_linear_scratch_bytes`` bytes; ``gemv``: override the decode variant (M
    <= 32; benchmarks sweep it); ``semaphores``: :func:`gemv_semaphores`, for a split-K variant
    to sum its partials in its own launch."""
    check_tensor("fp8_linear", "x", x, shape=(None, None), dtypes=_ACT_DTYPES, device=x.device)
    check_tensor("fp8_linear", "out", out, shape=(x.shape[0], None), dtypes=_ACT_DTYPES,
                 device=x.device)
    _fp8_linear("fp8_linear", x.unsqueeze(1), weight, scale, out.unsqueeze(1), block, workspace,
                gemv, semaphores)
    return out


def fp8_grouped_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                       out: torch.Tensor, block: tuple[int, int] = (128, 128), *,
                       workspace: torch.Tensor | None = None,
                       gemv: Fp8GemvVariant | None = None,
                       semaphores: torch.Tensor | None = None) -> torch.Tensor:
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
    _fp8_linear(name, x, weight, scale, out.view(m, groups, -1), block, workspace, gemv,
                semaphores)
    return out


def _fp8_linear(name: str, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                out: torch.Tensor, block: tuple[int, int], workspace: torch.Tensor | None,
                gemv: Fp8GemvVariant | None, semaphores: torch.Tensor | None = None) -> None:
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
    if m <= 32:
        gemv = gemv or fp8_gemv_variant(m, groups * n, k, block[1])
    if m <= 32 and gemv is not None:
        if block[1] % gemv.tiles[2]:
            raise KernelArgumentError(name, "gemv", f"BLOCK_K {gemv.tiles[2]} must divide the "
                                      f"scale block's K {block[1]}")
        need = fp8_linear_scratch_bytes(m, groups * n, k, block, gemv)
        partial = None
        if need:
            if workspace is None:
                workspace = torch.empty(need, dtype=torch.uint8, device=dev)
            if workspace.dtype != torch.uint8 or workspace.numel() < need or workspace.device != dev:
                raise KernelArgumentError(name, "workspace", f"must be uint8 on {dev} with >= "
                                          f"{need} bytes, got {workspace.dtype} x {workspace.numel()}")
            partial = workspace[:need].view(torch.float32).view(-1, m, groups * n)
        if semaphores is not None:
            check_tensor(name, "semaphores", semaphores, shape=(None,), dtypes=(torch.int32,),
                         device=dev)
            if (not SERIAL_SPLIT_REDUCE or semaphores.numel()
                    < gemv_semaphores_needed(m, groups * n, gemv.tiles, gemv.form, groups)):
                semaphores = None  # the two-launch reduce
        launch_fp8_gemv(x, weight.view(torch.uint8), scale, out, block, gemv.tiles, gemv.split,
                        partial, gemv.form, semaphores)
    else:
        launch_fp8_linear(x, weight.view(torch.uint8), scale, out, block,
                          fp8_linear_tiles(m, groups * n, block[1]))
