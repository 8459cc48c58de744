"""Triton kernels of the prefill form of the MXFP4 routed experts (see ``kernels.mxfp4_moe``):
FP8 x FP8 expert GEMMs on the rows the counting sort of ``_mxfp4_moe_triton`` ordered.

The tokens are quantized to e4m3 per 1 x 128 group once (``_fp8_w8a8_triton``'s quantizer);
the gate-up kernel quantizes its SwiGLU output per 1 x 128 group in its epilogue (BLOCK_N is
the group), so the down kernel reads FP8 codes too. Weights are decoded from packed e2m1 bytes
to e4m3 codes in integer ops: a K-tile of 128 spans four e8m0 scales of a row; the largest
becomes the row's scale for the tile and each value's e4m3 exponent is shifted by its group's
distance to it (exact down to 6 binades below the largest; a value further down, which
contributes under 2**-8 of the largest, is rounded to the nearest multiple of 2**-9 of it).
The MMA is ``tl.dot`` on e4m3 operands with fp32 accumulation (SM89+: SM90 and SM120); each
K-tile's partial is multiplied by the activation row scales and the weight row scales (a
K-tile is 64 or 128 wide: within one activation group, across two or four weight groups). Under
the interpreter both operands are decoded to fp32 exactly and the dot is IEEE fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._fp8_linear_triton import e4m3_bits_to_f16
from kernels._fp8_w8a8_triton import f32_to_e4m3_bits
from kernels._moe_sort_triton import _expert_tile


@triton.jit
def _mxfp4_tile_e4m3(w_rows, s_rows, kb, kg, n_ok, K_BYTES, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    """``BLOCK_N`` rows at packed byte columns ``kb`` [BK/2] and scale groups ``kg`` [BK/32]
    -> (uint8 e4m3 codes [BN, BK] of value / 2**(smax - 127), fp32 2**(smax - 127) [BN])."""
    ok = n_ok[:, None] & (kb < K_BYTES)[None, :]
    b = tl.load(w_rows + kb[None, :], mask=ok, other=0).to(tl.int32)
    nib = tl.interleave(b & 0xF, b >> 4)  # [BN, BK], lower nibble is the even column
    sc = tl.load(s_rows + kg[None, :], mask=n_ok[:, None] & (kg < K_BYTES // 16)[None, :],
                 other=0).to(tl.int32)  # [BN, BK/32]
    smax = tl.max(sc, 1)
    mag = nib & 7
    # e2m1 magnitude code -> e4m3 exponent field 6 + (mag >> 1) (0.5 = 2**-1 has field 6) and
    # mantissa bit (mag & 1) << 2 above 1.0; then the group's shift below the row's largest
    field = (6 + (mag >> 1)).reshape(BLOCK_N, BLOCK_K // 32, 32) + (sc - smax[:, None])[:, :, None]
    field = field.reshape(BLOCK_N, BLOCK_K)
    mant = tl.where(mag >= 2, (mag & 1) << 2, 0)
    sub = (8 + mant) >> tl.minimum(tl.maximum(1 - field, 0), 15)  # subnormal: (1 + m/8) 2**(f-7)
    code = tl.where(field >= 1, (field << 3) | mant, sub)
    code = tl.where(mag == 0, 0, code) | ((nib & 8) << 4)
    return code.to(tl.uint8), (smax << 23).to(tl.float32, bitcast=True)


@triton.jit
def _dot_e4m3(a, b, HW: tl.constexpr):
    """a [M, K] @ b [N, K]^T on uint8 e4m3 codes, fp32 result."""
    if HW:
        r = tl.dot(a.to(tl.float8e4nv, bitcast=True), tl.trans(b.to(tl.float8e4nv, bitcast=True)))
    else:  # e4m3 -> fp16 holds value / 256: the product is off by 2**16
        r = tl.dot(e4m3_bits_to_f16(a).to(tl.float32), tl.trans(e4m3_bits_to_f16(b).to(tl.float32)),
                   input_precision="ieee") * 65536.0
    return r


@triton.jit
def _moe_gate_up_fp8_kernel(
    xq_ptr, xs_ptr, order_ptr, row_end_ptr, w_ptr, s_ptr, hq_ptr, hs_ptr,
    E, H, INTER, TOP_K, NKB_H, NKB_I,
    stride_we, stride_wn, stride_se, stride_sn,
    limit,
    HW: tl.constexpr, E_P2: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """hq[row, n] / hs[row, n // BLOCK_N] = e4m3 quantization of swiglu(x[token] @ gate[e, n]^T,
    x[token] @ up[e, n]^T) per 1 x GROUP group (BLOCK_N = GROUP; BLOCK_K divides GROUP, so a
    K-tile has one activation scale a row)."""
    e, valid, row0, row_end = _expert_tile(row_end_ptr, tl.program_id(0), E, BLOCK_M, E_P2)
    if valid:
        rows = row0 + tl.arange(0, BLOCK_M)
        r_ok = rows < row_end
        tok = tl.load(order_ptr + rows, mask=r_ok, other=0) // TOP_K
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < INTER
        wg = w_ptr + e.to(tl.int64) * stride_we + n[:, None] * stride_wn
        sg = s_ptr + e.to(tl.int64) * stride_se + n[:, None] * stride_sn
        wu = wg + INTER * stride_wn
        su = sg + INTER * stride_sn
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros_like(acc_g)
        for k0 in range(0, H, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            kg = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            a = tl.load(xq_ptr + tok[:, None].to(tl.int64) * H + k[None, :],
                        mask=r_ok[:, None] & (k < H)[None, :], other=0)
            sa = tl.load(xs_ptr + tok.to(tl.int64) * NKB_H + k0 // GROUP, mask=r_ok, other=0.0)
            cg, sbg = _mxfp4_tile_e4m3(wg, sg, kb, kg, n_ok, H // 2, BLOCK_N, BLOCK_K)
            acc_g += _dot_e4m3(a, cg, HW) * sa[:, None] * sbg[None, :]
            cu, sbu = _mxfp4_tile_e4m3(wu, su, kb, kg, n_ok, H // 2, BLOCK_N, BLOCK_K)
            acc_u += _dot_e4m3(a, cu, HW) * sa[:, None] * sbu[None, :]
        g = tl.minimum(acc_g, limit)
        u = tl.minimum(tl.maximum(acc_u, -limit), limit)
        h = tl.where(n_ok[None, :], g * tl.sigmoid(g) * u, 0.0)
        amax = tl.maximum(tl.max(tl.abs(h), 1), 1e-10)
        s = amax / 448.0
        code = f32_to_e4m3_bits(tl.minimum(tl.maximum(tl.math.div_rn(h, s[:, None]), -448.0), 448.0))
        tl.store(hq_ptr + rows[:, None].to(tl.int64) * INTER + n[None, :], code,
                 mask=r_ok[:, None] & n_ok[None, :])
        tl.store(hs_ptr + rows.to(tl.int64) * NKB_I + tl.program_id(1), s, mask=r_ok)


@triton.jit
def _moe_down_fp8_kernel(
    hq_ptr, hs_ptr, order_ptr, row_end_ptr, tw_ptr, w_ptr, s_ptr, y_ptr,
    E, H, INTER, NKB_I,
    stride_we, stride_wn, stride_se, stride_sn, stride_ym,
    HW: tl.constexpr, E_P2: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """y[pair, n] = routing weight[pair] * (dequant(hq[row]) @ down[e, n]^T), stored at the
    pair's unsorted index (the combine reads each token's top-k rows contiguously)."""
    e, valid, row0, row_end = _expert_tile(row_end_ptr, tl.program_id(0), E, BLOCK_M, E_P2)
    if valid:
        rows = row0 + tl.arange(0, BLOCK_M)
        r_ok = rows < row_end
        pair = tl.load(order_ptr + rows, mask=r_ok, other=0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < H
        wd = w_ptr + e.to(tl.int64) * stride_we + n[:, None] * stride_wn
        sd = s_ptr + e.to(tl.int64) * stride_se + n[:, None] * stride_sn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            kg = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            a = tl.load(hq_ptr + rows[:, None].to(tl.int64) * INTER + k[None, :],
                        mask=r_ok[:, None] & (k < INTER)[None, :], other=0)
            sa = tl.load(hs_ptr + rows.to(tl.int64) * NKB_I + k0 // GROUP, mask=r_ok, other=0.0)
            cd, sb = _mxfp4_tile_e4m3(wd, sd, kb, kg, n_ok, INTER // 2, BLOCK_N, BLOCK_K)
            acc += _dot_e4m3(a, cd, HW) * sa[:, None] * sb[None, :]
        tw = tl.load(tw_ptr + pair, mask=r_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + pair[:, None] * stride_ym + n[None, :],
                 (acc * tw[:, None]).to(y_ptr.dtype.element_ty), mask=r_ok[:, None] & n_ok[None, :])


Fp8MoeTiles = tuple[int, int, int, int, int]  # BLOCK_M, BLOCK_N (down), BLOCK_K, warps, stages
GROUP = 128  # the activation group: BLOCK_N of the gate-up; BLOCK_K divides it


def fp8_moe_tiles(interpret: bool) -> Fp8MoeTiles:
    """Tiles of both FP8 GEMMs: 128-row expert tiles (a decoded weight tile feeds 128 rows),
    K-tiles of 64 (half a scale group: the decoded [128, 64] weight tile's integer temporaries
    stay in registers next to the gate-up kernel's two 128 x 128 fp32 accumulators)."""
    return (32, 32, 64, 4, 1) if interpret else (128, 128, 64, 8, 3)


def launch_moe_fp8_gemms(xq: torch.Tensor, xs: torch.Tensor, order: torch.Tensor,
                         row_end: torch.Tensor, tw: torch.Tensor, gate_up: torch.Tensor,
                         gate_up_scale: torch.Tensor, down: torch.Tensor,
                         down_scale: torch.Tensor, limit: float, hq: torch.Tensor,
                         hs: torch.Tensor, y: torch.Tensor, top_k: int, e_p2: int, hw: bool,
                         tiles: Fp8MoeTiles) -> None:
    """xq [T, H] codes, xs [T, ceil(H/128)]; hq [P, I] and hs [P, ceil(I/128)] are written,
    then y [P, H] (routing-weighted expert outputs at their pair index)."""
    e, hid, inter = gate_up.shape[0], xq.shape[1], down.shape[-1] * 2
    bm, bn, bk, warps, stages = tiles
    assert GROUP % bk == 0 and bk >= 32, tiles
    m = order.numel()
    max_tiles = min(m, triton.cdiv(m, bm) + e - 1)
    _moe_gate_up_fp8_kernel[(max_tiles, triton.cdiv(inter, GROUP))](
        xq, xs, order, row_end, gate_up, gate_up_scale, hq, hs, e, hid, inter, top_k,
        xs.shape[1], hs.shape[1], gate_up.stride(0), gate_up.stride(1),
        gate_up_scale.stride(0), gate_up_scale.stride(1), float(limit),
        HW=hw, E_P2=e_p2, GROUP=GROUP, BLOCK_M=bm, BLOCK_N=GROUP, BLOCK_K=bk, num_warps=warps,
        num_stages=stages)
    _moe_down_fp8_kernel[(max_tiles, triton.cdiv(hid, bn))](
        hq, hs, order, row_end, tw, down, down_scale, y, e, hid, inter, hs.shape[1],
        down.stride(0), down.stride(1), down_scale.stride(0), down_scale.stride(1), y.stride(0),
        HW=hw, E_P2=e_p2, GROUP=GROUP, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
        num_stages=stages)
