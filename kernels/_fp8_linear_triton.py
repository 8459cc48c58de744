"""Triton kernel of the block-scaled FP8 linear (see ``kernels.fp8_linear``).

The weight arrives as raw e4m3 bytes. On the GPU (bf16/fp16 activations) it is decoded by the
hardware's e4m3 conversion (SM89+: SM90, SM120; the decode GEMV's straight to the activations'
dtype); with fp32 activations and under TRITON_INTERPRET=1 by integer ops and a bitcast to
fp16 (exact: e4m3's exponent and mantissa fit fp16's, off by a factor 2**8). Both keep NaN
codes NaN. No wgmma/TMA-only code path. Activations stay in their own dtype (bf16 on the GPU)
and the dot accumulates in fp32; the block scale multiplies each K-tile's partial product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._fp8_gemv_split import gemv_k_split, gemv_num_splits, gemv_semaphores_needed
from kernels._pdl_triton import l2_prefetch, pdl_wait
from kernels._triton_support import PDL_PREFETCH, interpreting, pdl_kwargs

E4M3_TO_F16_FACTOR = 256.0  # e4m3 bits placed in an fp16 read 2**-8 of their value


@triton.jit
def e4m3_bits_to_f16(b, HW: tl.constexpr = False):
    """uint8 e4m3 bits -> fp16 holding value / 256 (exact for every finite e4m3); the NaN
    codes 0x7F / 0xFF stay NaN, as in torch's float8_e4m3fn (the reference). HW: the GPU's own
    e4m3 -> fp16 conversion (SM89+, two values an instruction); else integer ops and a bitcast
    (the interpreter, whose fp8 conversion is not exact)."""
    if HW:
        v = b.to(tl.float8e4nv, bitcast=True).to(tl.float16) * 0.00390625
    else:
        b16 = b.to(tl.uint16)
        bits = ((b16 & 0x80) << 8) | ((b16 & 0x7F) << 7)
        bits = tl.where((b16 & 0x7F) == 0x7F, 0x7E00, bits)
        v = bits.to(tl.float16, bitcast=True)
    return v


@triton.jit
def dot_nt(a, b, F32: tl.constexpr):
    """a [M, K] @ b[N, K]^T in fp32. F32: both operands as fp32 with an IEEE dot (fp32
    activations, and the interpreter, whose bf16 dot is wrong); else b in a's dtype."""
    if F32:
        return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
    return tl.dot(a, tl.trans(b.to(tl.float32).to(a.dtype)))


@triton.jit
def _fp8_linear_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_xg, stride_wn, stride_sn, stride_ym, stride_yg,
    SCALE_BN, SCALE_BK,
    TILE_SCALE: tl.constexpr,  # True: BLOCK_K divides SCALE_BK, one scale per row per K-tile
    F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    g = tl.program_id(2)  # group of a block-diagonal weight: rows g*N.., x and y columns g*K..
    x_ptr += g * stride_xg
    y_ptr += g * stride_yg
    w_ptr += g * N * stride_wn
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    s_row = s_ptr + ((offs_n + g * N) // SCALE_BN) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        wb = tl.load(w_ptr + offs_n[:, None] * stride_wn + k[None, :],
                     mask=n_ok[:, None] & k_ok[None, :], other=0)
        w = e4m3_bits_to_f16(wb, not F32)
        if TILE_SCALE:
            s = tl.load(s_row + k0 // SCALE_BK, mask=n_ok, other=0.0)  # [BLOCK_N]
            acc += dot_nt(x, w, F32) * s[None, :]
        else:
            s = tl.load(s_row[:, None] + (k // SCALE_BK)[None, :],
                        mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
            acc += dot_nt(x, w.to(tl.float32) * s, F32)
    acc = acc * 256.0
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _last_slice_sum(p_tile, o_tile, mask, stride_ys, SLICES, sem_ptr, tile):
    """Split-K without a second launch: each slice has stored its fp32 partial (``p_tile``, the
    pointers of slice 0's tile, slice s at ``+ s * stride_ys``); the program that counts in last
    on ``sem_ptr[tile]`` sums all ``SLICES`` partials in slice order (the same sum, bit for bit,
    as ``_split_k_reduce_kernel``), stores it at ``o_tile`` and puts the counter back to 0 for
    the next launch. The barrier orders every thread's partial store before the counting
    atomic (release at GPU scope, the grid-sync pattern); the last program's acquire orders its
    reads after the other slices' stores, which it reads from L2 (``.cg``), not L1."""
    tl.debug_barrier()
    count = tl.atomic_add(sem_ptr + tile, 1, sem="acq_rel")
    if count == SLICES - 1:
        acc = tl.load(p_tile, mask=mask, other=0.0, cache_modifier=".cg")
        for s in range(1, SLICES):
            acc += tl.load(p_tile + s * stride_ys, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(o_tile, acc.to(o_tile.dtype.element_ty), mask=mask)
        tl.atomic_xchg(sem_ptr + tile, 0)


@triton.jit
def _prefetch_gemv_weights(w_ptr, N, K, SPLIT_TILES, stride_wn, M_TILES,
                           SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The decode GEMVs' ``PDL`` bit 4: before the program waits on the previous kernel, ask
    L2 for the weight bytes it will stream (its rows, its K slice), so HBM is busy while the
    previous kernel finishes. Program ids as in the GEMV kernels (axis 0: K slice x
    ``M_TILES``). The launcher sets the bit only where K, the row stride and the base are
    multiples of 16 (the bulk prefetch's rule)."""
    n0 = tl.program_id(1) * BLOCK_N
    rows = tl.minimum(N - n0, BLOCK_N)
    base = w_ptr + (tl.program_id(2) * N + n0) * stride_wn
    if SPLIT:  # the slice's K range of each row: one prefetch a row
        k_lo = (tl.program_id(0) // M_TILES) * SPLIT_TILES * BLOCK_K
        nbytes = tl.minimum(K - k_lo, SPLIT_TILES * BLOCK_K)
        for r in tl.static_range(BLOCK_N):
            if r < rows:
                l2_prefetch(base + r * stride_wn + k_lo, nbytes)
    else:  # whole rows: one span
        l2_prefetch(base, (rows - 1) * stride_wn + K)


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr,
    M, N, K, SPLIT_TILES,
    stride_xm, stride_xg, stride_wn, stride_sn, stride_ym, stride_yg, stride_ys,
    SCALE_BN, SCALE_BK,
    o_ptr, stride_om, stride_og, sem_ptr, SLICES,
    F32: tl.constexpr, SPLIT: tl.constexpr, SERIAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr,
    EVEN_K: tl.constexpr = False, PDL: tl.constexpr = 0,
):
    """Few rows (decode): the weight-streaming form. Operands swapped (acc [BN, BM] = W x^T) so
    the decoded weight tile is the dot's wide side and a narrow ``BLOCK_N`` spreads N over many
    programs; ``UNROLL`` K-tiles are loaded per trip so more weight bytes are in flight. Needs
    BLOCK_K | SCALE_BK: one scale per weight row per K-tile.
    Split-K: grid axis 0 is (K slice, M tile); slice ``s`` covers the ``SPLIT_TILES`` K-tiles
    from tile ``s * SPLIT_TILES`` and writes its fp32 partial at ``y + s * stride_ys`` (one
    slice: the output itself). Slices are whole K-tiles, so the one-scale-per-tile rule holds.
    ``SERIAL``: the last slice of a tile to finish sums the partials into ``o`` [M, G, N]
    (``_last_slice_sum``, one int32 counter a tile at ``sem_ptr``); else a second launch does.
    ``EVEN_K``: K is whole K-tiles, so a tile is masked by rows and one predicate, never
    column by column. On the GPU the weight bytes go through the hardware's e4m3 conversion
    straight to the activations' dtype (no 2**-8 factor to take back)."""
    if PDL & 4:  # weights only: never written during a step (kernels/NOTES.md)
        _prefetch_gemv_weights(w_ptr, N, K, SPLIT_TILES, stride_wn, tl.cdiv(M, BLOCK_M),
                               SPLIT, BLOCK_N, BLOCK_K)
    pdl_wait(PDL)  # before any other memory access (kernels/NOTES.md)
    pid_m = tl.program_id(0)
    split = 0
    if SPLIT:
        pid_m = tl.program_id(0) % tl.cdiv(M, BLOCK_M)
        split = tl.program_id(0) // tl.cdiv(M, BLOCK_M)
    pid_n = tl.program_id(1)
    g = tl.program_id(2)
    x_ptr += g * stride_xg
    p_ptr = y_ptr + g * stride_yg  # slice 0's partials of this group
    y_ptr = p_ptr + split * stride_ys
    w_ptr += g * N * stride_wn
    k_lo = 0
    k_hi = K
    if SPLIT:  # (static: the unsplit launch compiles to the plain K loop)
        k_lo = split * SPLIT_TILES * BLOCK_K  # a product with BLOCK_K: loads stay vectorised
        k_hi = tl.minimum(K, k_lo + SPLIT_TILES * BLOCK_K)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    s_row = s_ptr + ((offs_n + g * N) // SCALE_BN) * stride_sn
    w_rows = w_ptr + offs_n[:, None] * stride_wn
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K * UNROLL):
        for u in tl.static_range(UNROLL):
            k = k0 + u * BLOCK_K + offs_k
            if EVEN_K:  # whole K-tiles: masked by rows (and, past the first, the tile)
                w_ok = n_ok[:, None]  # (a load broadcasts its mask over the tile)
                x_ok = m_ok[None, :]
                if u > 0:  # (a where: under the interpreter the bound may be a Python bool)
                    w_ok = tl.where(k0 + u * BLOCK_K < k_hi, w_ok, False)
                    x_ok = tl.where(k0 + u * BLOCK_K < k_hi, x_ok, False)
                wb = tl.load(w_rows + k[None, :], mask=w_ok, other=0)
                xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + k[:, None], mask=x_ok,
                             other=0.0)  # [BK, BM]
            else:
                k_ok = k < k_hi
                wb = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
                xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + k[:, None],
                             mask=k_ok[:, None] & m_ok[None, :], other=0.0)  # [BK, BM]
            # a K-tile past the end is all masked: read any in-bounds scale for it
            s = tl.load(s_row + tl.minimum(k0 + u * BLOCK_K, k_hi - 1) // SCALE_BK, mask=n_ok,
                        other=0.0)
            if F32:
                w = e4m3_bits_to_f16(wb, False)
                part = tl.dot(w.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
            else:  # the GPU's own e4m3 conversion: the value itself, no 2**8 factor
                part = tl.dot(wb.to(tl.float8e4nv, bitcast=True).to(xt.dtype), xt)
            acc += part * s[:, None]
    if F32:
        acc = acc * 256.0
    tile_off = offs_m[None, :] * stride_ym + offs_n[:, None]
    mask = n_ok[:, None] & m_ok[None, :]
    tl.store(y_ptr + tile_off, acc.to(y_ptr.dtype.element_ty), mask=mask)
    if SPLIT and SERIAL:
        tile = (g * tl.num_programs(1) + pid_n) * tl.cdiv(M, BLOCK_M) + pid_m
        _last_slice_sum(p_ptr + tile_off,
                        o_ptr + g * stride_og + offs_m[None, :] * stride_om + offs_n[:, None],
                        mask, stride_ys, SLICES, sem_ptr, tile)


@triton.jit
def _fp8_gemv_sum_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr,
    M, N, K, SPLIT_TILES,
    stride_xm, stride_xg, stride_wn, stride_sn, stride_ym, stride_yg, stride_ys,
    SCALE_BN, SCALE_BK,
    o_ptr, stride_om, stride_og, sem_ptr, SLICES,
    HW: tl.constexpr, SPLIT: tl.constexpr, SERIAL: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr, PDL: tl.constexpr = 0,
):
    """The no-dot decode form: one activation row a program, ``BLOCK_N`` (4-16) weight rows
    decoded and multiplied elementwise into a [BN, BK] fp32 accumulator that is summed once at
    the end. With no MMA tile to fill, N splits into many more programs than the dot form's
    (more loads in flight at M = 1); a second row re-reads the weight (from L2), so it is for
    one or a few rows. Grid axis 0 is (K slice, row); split-K (``SERIAL`` too) as in
    ``_fp8_gemv_kernel``."""
    if PDL & 4:  # weights only: never written during a step (kernels/NOTES.md)
        _prefetch_gemv_weights(w_ptr, N, K, SPLIT_TILES, stride_wn, M, SPLIT, BLOCK_N, BLOCK_K)
    pdl_wait(PDL)  # before any other memory access (kernels/NOTES.md)
    row = tl.program_id(0)
    split = 0
    if SPLIT:
        row = tl.program_id(0) % M
        split = tl.program_id(0) // M
    pid_n = tl.program_id(1)
    g = tl.program_id(2)
    x_ptr += g * stride_xg + row * stride_xm
    p_ptr = y_ptr + g * stride_yg + row * stride_ym  # slice 0's partial row
    y_ptr = p_ptr + split * stride_ys
    w_ptr += g * N * stride_wn
    k_lo = 0
    k_hi = K
    if SPLIT:  # (static: the unsplit launch compiles to the plain K loop)
        k_lo = split * SPLIT_TILES * BLOCK_K  # a product with BLOCK_K: loads stay vectorised
        k_hi = tl.minimum(K, k_lo + SPLIT_TILES * BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    s_row = s_ptr + ((offs_n + g * N) // SCALE_BN) * stride_sn
    w_rows = w_ptr + offs_n[:, None] * stride_wn
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K * UNROLL):
        for u in tl.static_range(UNROLL):
            k = k0 + u * BLOCK_K + offs_k
            k_ok = k < k_hi
            wb = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
            xk = tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            s = tl.load(s_row + tl.minimum(k0 + u * BLOCK_K, k_hi - 1) // SCALE_BK, mask=n_ok,
                        other=0.0)
            w = e4m3_bits_to_f16(wb, HW).to(tl.float32)
            acc += w * s[:, None] * xk[None, :]
    y = tl.sum(acc, 1) * 256.0
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)
    if SPLIT and SERIAL:
        tile = (g * tl.num_programs(1) + pid_n) * M + row
        _last_slice_sum(p_ptr + offs_n, o_ptr + g * stride_og + row * stride_om + offs_n, n_ok,
                        stride_ys, SLICES, sem_ptr, tile)


@triton.jit
def _split_k_reduce_kernel(p_ptr, y_ptr, N, NG, SPLIT, stride_ps, stride_pm, stride_ym, stride_yg,
                           BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    """y[m, g, n] = sum over slices s of p[s, m, g * N + n], in slice order (deterministic)."""
    pdl_wait(PDL)  # before any memory access (kernels/NOTES.md)
    m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < NG
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, SPLIT):
        acc += tl.load(p_ptr + s * stride_ps + m * stride_pm + cols, mask=ok, other=0.0)
    g = cols // N
    tl.store(y_ptr + m * stride_ym + g * stride_yg + (cols - g * N),
             acc.to(y_ptr.dtype.element_ty), mask=ok)


GemvTiles = tuple[int, int, int, int, int, int]  # BM, BN, BK, UNROLL, num_warps, num_stages


def launch_fp8_gemv(x: torch.Tensor, w_u8: torch.Tensor, scale: torch.Tensor, out: torch.Tensor,
                    block: tuple[int, int], tiles: GemvTiles, split: int = 1,
                    partial: torch.Tensor | None = None, form: str = "dot",
                    semaphores: torch.Tensor | None = None) -> None:
    """x [M, G, K], w_u8 [G * N, K], out [M, G, N]; M small; BLOCK_K must divide block[1].
    ``split`` > 1: K cut into ``gemv_num_splits`` slices whose fp32 partials go to
    ``partial`` [>= slices, M, G * N] (contiguous rows) and are summed into ``out`` in slice
    order: by the last slice of each output tile when ``semaphores`` (int32, zero, at least
    ``gemv_semaphores_needed`` of them; left zero again) is given, else by a second launch.
    ``form``: "dot" (``_fp8_gemv_kernel``) or "sum" (``_fp8_gemv_sum_kernel``, BLOCK_M
    unused)."""
    m, groups, k = x.shape
    n = w_u8.shape[0] // groups
    bm, bn, bk, unroll, warps, stages = tiles
    assert block[1] % bk == 0, (block, bk)
    k_split = gemv_k_split(k, bk, split)
    slices = gemv_num_splits(k, bk, split)
    dst = out
    stride_ys = 0
    serial = False
    sem = out  # any pointer: unused unless serial
    if slices > 1:
        assert partial is not None and partial.dtype == torch.float32, "split-K needs fp32 scratch"
        assert partial.shape[0] >= slices and partial.shape[1:] == (m, groups * n), partial.shape
        assert partial.stride(2) == 1 and partial.stride(1) == groups * n, partial.stride()
        dst = partial.view(partial.shape[0], m, groups, n)[0]
        stride_ys = partial.stride(0)
        if semaphores is not None:
            need = gemv_semaphores_needed(m, groups * n, tiles, form, groups)
            assert semaphores.dtype == torch.int32 and semaphores.numel() >= need, (
                semaphores.dtype, semaphores.numel(), need)
            serial, sem = True, semaphores
    args = (x, w_u8, scale, dst, m, n, k, k_split // bk,
            x.stride(0), x.stride(1), w_u8.stride(0), scale.stride(0), dst.stride(0),
            dst.stride(1), stride_ys, block[0], block[1],
            out, out.stride(0), out.stride(1), sem, slices)
    pdl = pdl_kwargs(x.device)
    if pdl and not (k % 16 == 0 and w_u8.stride(0) % 16 == 0 and w_u8.data_ptr() % 16 == 0):
        pdl["PDL"] = int(pdl["PDL"]) & ~PDL_PREFETCH  # the bulk prefetch needs 16-byte multiples
    if form == "sum":
        _fp8_gemv_sum_kernel[(m * slices, triton.cdiv(n, bn), groups)](
            *args, HW=not (x.dtype == torch.float32 or interpreting()), SPLIT=slices > 1,
            SERIAL=serial, BLOCK_N=bn, BLOCK_K=bk, UNROLL=unroll, num_warps=warps,
            num_stages=stages, **pdl)
    else:
        assert form == "dot", form
        _fp8_gemv_kernel[(triton.cdiv(m, bm) * slices, triton.cdiv(n, bn), groups)](
            *args, F32=x.dtype == torch.float32 or interpreting(), SPLIT=slices > 1,
            SERIAL=serial, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, UNROLL=unroll, num_warps=warps,
            num_stages=stages, EVEN_K=k % bk == 0, **pdl)
    if slices > 1 and not serial:
        assert partial is not None
        rb = 1024
        _split_k_reduce_kernel[(m, triton.cdiv(groups * n, rb))](
            partial, out, n, groups * n, slices, partial.stride(0), partial.stride(1),
            out.stride(0), out.stride(1), BLOCK=rb, **pdl)


def launch_fp8_linear(x: torch.Tensor, w_u8: torch.Tensor, scale: torch.Tensor, out: torch.Tensor,
                      block: tuple[int, int], tiles: tuple[int, int, int, int]) -> None:
    """x [M, G, K], w_u8 [G * N, K], out [M, G, N] (G = 1 for a plain linear)."""
    m, groups, k = x.shape
    n = w_u8.shape[0] // groups
    bm, bn, bk, warps = tiles
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), groups)
    _fp8_linear_kernel[grid](
        x, w_u8, scale, out, m, n, k,
        x.stride(0), x.stride(1), w_u8.stride(0), scale.stride(0), out.stride(0), out.stride(1),
        block[0], block[1],
        TILE_SCALE=block[1] % bk == 0, F32=x.dtype == torch.float32 or interpreting(),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
    )
