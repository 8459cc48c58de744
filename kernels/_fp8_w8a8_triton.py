"""Triton kernels of the prefill FP8 linear (see ``kernels.fp8_w8a8``): per-1x128-group e4m3
quantization of the activations, then an FP8 x FP8 block-scaled GEMM.

The quantizer rounds to nearest, ties to even, as torch's ``.to(float8_e4m3fn)``: on the GPU by
the hardware's conversion, under the interpreter in integer ops; both give the reference's
codes (the integer form took ~1.7x the sm_90 instructions of a tile).

The GEMM feeds the raw e4m3 bytes of both operands to ``tl.dot`` (the tensor cores' FP8 MMA
on SM89+: SM90 and SM120 alike, no wgmma/TMA-only code) and applies the activation scale of
each (row, K-tile) and the weight scale of each (row block, K-tile) to the K-tile's fp32
partial product: BLOCK_K is the scale group (128), so one scale pair multiplies each
partial. Under the interpreter (no FP8 dot) both operands are
decoded exactly to fp32 by integer ops and the dot is an IEEE fp32 one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._fp8_linear_triton import e4m3_bits_to_f16
from kernels._triton_support import interpreting

_QUANT_ROWS = 32
E4M3_MAX = 448.0


@triton.jit
def f32_to_e4m3_bits(v):
    """fp32 values with |v| <= 448 -> uint8 e4m3 codes, rounded to nearest, ties to even.
    Normal range (|v| >= 2**-6): round the fp32 mantissa to 3 bits on its bit pattern (a carry
    moves into the exponent by itself); below it: the subnormal quantum is 2**-9, so round
    |v| * 512 (exact) to an integer, 8 landing on the smallest normal's code."""
    a = tl.abs(v)
    bits = a.to(tl.uint32, bitcast=True)
    r = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
    exp = (r >> 23).to(tl.int32) - 127
    normal = ((exp + 7) << 3) | ((r >> 20) & 7).to(tl.int32)
    y = a * 512.0
    fl = y.to(tl.int32)  # floor: y >= 0
    frac = y - fl.to(tl.float32)
    sub = fl + ((frac > 0.5) | ((frac == 0.5) & ((fl & 1) == 1))).to(tl.int32)
    code = tl.where(a < 0.015625, sub, normal)
    code = code | ((v.to(tl.uint32, bitcast=True) >> 24) & 0x80).to(tl.int32)  # sign, -0 too
    return code.to(tl.uint8)


@triton.jit
def _act_quant_kernel(
    x_ptr, q_ptr, s_ptr, M, G, K, NKB,
    stride_xm, stride_xg,
    AMAX_FLOOR: tl.constexpr, BLOCK_R: tl.constexpr, GROUP: tl.constexpr,
    HW: tl.constexpr = False,
):
    """Rows ``BLOCK_R`` x one K-group of one block-diagonal group ``g``: q [M, G, K] uint8 and
    s [M, G, NKB] fp32, both contiguous. ``HW``: the GPU's own fp32 -> e4m3 conversion (SM89+,
    round to nearest even like torch's; the values are clamped to +-448 first, so its
    saturation never acts), else the integer rounding of :func:`f32_to_e4m3_bits`."""
    pid_r = tl.program_id(0)
    g = tl.program_id(1) // NKB
    kb = tl.program_id(1) % NKB
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = kb * GROUP + tl.arange(0, GROUP)
    ok = (rows < M)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + g * stride_xg + cols[None, :],
                mask=ok, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), 1), AMAX_FLOOR)
    s = amax / 448.0
    v = tl.minimum(tl.maximum(tl.math.div_rn(x, s[:, None]), -448.0), 448.0)
    if HW:  # noqa: SIM108 (a static branch: the interpreter has no exact fp8 conversion)
        code = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        code = f32_to_e4m3_bits(v)
    qrow = (rows.to(tl.int64) * G + g) * K
    tl.store(q_ptr + qrow[:, None] + cols[None, :], code, mask=ok)
    tl.store(s_ptr + (rows.to(tl.int64) * G + g) * NKB + kb, s, mask=rows < M)


@triton.jit
def _fp8_w8a8_kernel(
    xq_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr,
    M, N, K, G, NKB,
    stride_wn, stride_sn, stride_ym, stride_yg,
    SCALE_BN,
    HW: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr = False, ONE_SB: tl.constexpr = False,
):
    """y[m, g, n] = sum over K-tiles kt of (xq[m, g, kt] . w[g*N + n, kt]) * xs[m, g, kt] *
    ws[(g*N + n) // SCALE_BN, kt]; xq [M, G, K] and xs [M, G, NKB] contiguous, BLOCK_K = the
    scale group. Programs are ordered GROUP_M row tiles at a time so a weight tile is reused
    from L2 by the row tiles that need it. ``EVEN_K``: K is whole K-tiles (no column masks).
    ``ONE_SB``: BLOCK_N divides the weight's scale block and N, so a tile's rows share one
    weight scale a K-tile, folded into the row scales (one multiply-add a value of the
    promotion, not two multiplies and an add: -28% of the sm_90 loop's instructions)."""
    pid = tl.program_id(0)
    g = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = xq_ptr + (offs_m.to(tl.int64) * G + g) * K
    xs_rows = xs_ptr + (offs_m.to(tl.int64) * G + g) * NKB
    w_rows = w_ptr + (g * N + offs_n).to(tl.int64) * stride_wn
    s_rows = ws_ptr + ((offs_n + g * N) // SCALE_BN) * stride_sn
    sb_tile = ws_ptr + ((pid_n * BLOCK_N + g * N) // SCALE_BN) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(0, NKB):
        k = kt * BLOCK_K + offs_k
        if EVEN_K:  # no mask along K: the loads stay 16-byte vectors (and pipeline)
            a = tl.load(x_rows[:, None] + k[None, :], mask=m_ok[:, None], other=0)
            b = tl.load(w_rows[:, None] + k[None, :], mask=n_ok[:, None], other=0)
        else:
            k_ok = k < K
            a = tl.load(x_rows[:, None] + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                        other=0)
            b = tl.load(w_rows[:, None] + k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0)
        sa = tl.load(xs_rows + kt, mask=m_ok, other=0.0)
        if HW:
            part = tl.dot(a.to(tl.float8e4nv, bitcast=True),
                          tl.trans(b.to(tl.float8e4nv, bitcast=True)))
        else:  # e4m3 -> fp16 holds value / 256: the product is off by 2**16
            part = tl.dot(e4m3_bits_to_f16(a).to(tl.float32),
                          tl.trans(e4m3_bits_to_f16(b).to(tl.float32)),
                          input_precision="ieee") * 65536.0
        if ONE_SB:  # the tile's rows share one weight scale: one multiply-add a value
            acc += part * (sa * tl.load(sb_tile + kt))[:, None]
        else:
            sb = tl.load(s_rows + kt, mask=n_ok, other=0.0)
            acc += part * sa[:, None] * sb[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + g * stride_yg + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


W8A8Tiles = tuple[int, int, int, int, int]  # BLOCK_M, BLOCK_N, GROUP_M, num_warps, num_stages


def launch_act_quant(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, group: int,
                     amax_floor: float, tiles: tuple[int, int] | None = None) -> None:
    """x [M, G, K] (last dim contiguous) -> q [M, G, K] uint8, s [M, G, ceil(K/group)] fp32.
    ``tiles``: (rows a program, warps) in place of the default (benchmarks sweep them)."""
    m, groups, k = x.shape
    nkb = triton.cdiv(k, group)
    block_r, warps = tiles or (_QUANT_ROWS, 4)
    _act_quant_kernel[(triton.cdiv(m, block_r), groups * nkb)](
        x, q, s, m, groups, k, nkb, x.stride(0), x.stride(1),
        AMAX_FLOOR=amax_floor, BLOCK_R=block_r, GROUP=group,
        HW=x.is_cuda and not interpreting(), num_warps=warps)


def launch_fp8_w8a8(q: torch.Tensor, s: torch.Tensor, w_u8: torch.Tensor, scale: torch.Tensor,
                    out: torch.Tensor, block: tuple[int, int], tiles: W8A8Tiles) -> None:
    """q [M, G, K] codes, s [M, G, NKB]; w_u8 [G * N, K]; out [M, G, N]; BLOCK_K = block[1]."""
    m, groups, k = q.shape
    n = w_u8.shape[0] // groups
    bm, bn, group_m, warps, stages = tiles
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), groups)
    _fp8_w8a8_kernel[grid](
        q, s, w_u8, scale, out, m, n, k, groups, s.shape[-1],
        w_u8.stride(0), scale.stride(0), out.stride(0), out.stride(1), block[0],
        HW=not interpreting(), GROUP_M=group_m, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=block[1],
        EVEN_K=k % block[1] == 0, ONE_SB=block[0] % bn == 0 and n % bn == 0,
        num_warps=warps, num_stages=stages)
