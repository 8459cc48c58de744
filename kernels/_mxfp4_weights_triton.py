"""Decoding MXFP4 weights in registers, shared by the MoE GEMMs (``_mxfp4_moe_triton``) and
their per-pair GEMVs (``_mxfp4_moe_gemv_triton``).

A weight tile is read as packed e2m1 bytes (two values a byte, the lower nibble the even column)
or, where the layout allows (:func:`_as_words`), as int32 words of eight values, and decoded by
bit manipulation (no fp4/fp8 dtype, no Hopper-only instruction); the e8m0 scale of each 32-wide
K group is applied by broadcasting over a [N, K/32, 32] view. Launches nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mxfp4_tile(w_rows, s_rows, kb, kg, n_ok, K_BYTES, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """``BLOCK_N`` rows (``w_rows``/``s_rows`` [BN, 1] row pointers) at packed byte columns
    ``kb`` [BK/2] and scale groups ``kg`` [BK/32] -> fp32 [BN, BK] in column order."""
    ok = n_ok[:, None] & (kb < K_BYTES)[None, :]
    b = tl.load(w_rows + kb[None, :], mask=ok, other=0).to(tl.int32)
    nib = tl.interleave(b & 0xF, b >> 4)  # lower nibble is the even column
    bits = ((nib & 8) << 12) | ((nib & 7) << 9)  # sign, then exponent+mantissa into fp16
    v = bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    sc = tl.load(s_rows + kg[None, :], mask=n_ok[:, None] & (kg < K_BYTES // 16)[None, :],
                 other=127).to(tl.int32)
    f = (sc << 23).to(tl.float32, bitcast=True) * 16384.0  # 2**(s-127), and fp16's 2**14 back
    v = v.reshape(BLOCK_N, BLOCK_K // 32, 32) * f[:, :, None]
    return v.reshape(BLOCK_N, BLOCK_K)



@triton.jit
def _bf16_pair(wd, J: tl.constexpr):
    """Nibbles ``J`` and ``J + 4`` of int32 words ``wd`` -> two bf16 tensors of value * 2**-126:
    both bf16 bit patterns built at once in the halves of one int32 (e2m1's exponent and
    mantissa shifted under bf16's, whose subnormals hold 0.5, and the sign), then split."""
    t = wd >> (4 * J)
    pair = ((t & 0x00070007) << 6) | ((t & 0x00080008) << 12)
    lo = pair.to(tl.int16).to(tl.bfloat16, bitcast=True)
    hi = (pair >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return lo, hi



@triton.jit
def _nibble_pair(wd, J: tl.constexpr):
    """Nibbles ``J`` and ``J + 4`` of int32 words ``wd`` (packed e2m1, nibble j is column
    8w + j) -> two fp32 tensors of value * 2**-14: both fp16 bit patterns are built at once in
    the two halves of one int32 (e2m1's exponent and mantissa shifted from bits 4J.. under
    fp16's bits 9-11, its sign from 4J + 3 to 15; fp16's subnormals hold 0.5), then split:
    two shifts and two masks a pair (the masks as signed int32 constants, so nothing widens)."""
    if J < 3:  # noqa: SIM108 (a static branch: a negative shift is not a shift)
        mag = wd << (9 - 4 * J)
    else:
        mag = wd >> 3
    pair = (mag & 0x0E000E00) | ((wd << (12 - 4 * J)) & -0x7FFF8000)  # 0x80008000 as int32
    lo = pair.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (pair >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi



@triton.jit
def _mxfp4_tile_words(w_rows, s_rows, kw, kg, n_ok, K_WORDS, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, F32: tl.constexpr):
    """``BLOCK_N`` rows (``w_rows`` [BN, 1] int32 word row pointers, ``s_rows`` scale rows) at
    word columns ``kw`` [BK/8] and scale groups ``kg`` [BK/32] -> [BN, BK] in column order
    (nibble j of word w is column 8w + j; joins put the decoded pairs in that order). bf16 with
    no float conversion: bf16 bit patterns (:func:`_bf16_pair`), times 2**126 and the group's
    e8m0 scale in bf16 (exact: powers of two; two products, as 2**(s - 1) alone overflows bf16
    from s = 129). F32 (fp32 activations, and the interpreter, whose bf16 arithmetic is not
    IEEE): fp32 from fp16 bit patterns (:func:`_nibble_pair`) scaled in fp32."""
    ok = n_ok[:, None] & (kw < K_WORDS)[None, :]
    wd = tl.load(w_rows + kw[None, :], mask=ok, other=0)
    sc = tl.load(s_rows + kg[None, :], mask=n_ok[:, None] & (kg < K_WORDS // 4)[None, :],
                 other=127).to(tl.int32)
    f = (sc << 23).to(tl.float32, bitcast=True)  # 2**(s - 127)
    if F32:
        lo0, hi0 = _nibble_pair(wd, 0)
        lo1, hi1 = _nibble_pair(wd, 1)
        lo2, hi2 = _nibble_pair(wd, 2)
        lo3, hi3 = _nibble_pair(wd, 3)
        f = f * 16384.0  # fp16's 2**14 back
    else:
        lo0, hi0 = _bf16_pair(wd, 0)
        lo1, hi1 = _bf16_pair(wd, 1)
        lo2, hi2 = _bf16_pair(wd, 2)
        lo3, hi3 = _bf16_pair(wd, 3)
        f = f.to(tl.bfloat16)
    # three joins: the first one's index (lo/hi: column bit 2) is the slowest of the three
    q0 = tl.join(tl.join(lo0, hi0), tl.join(lo2, hi2))
    q1 = tl.join(tl.join(lo1, hi1), tl.join(lo3, hi3))
    v = tl.join(q0, q1).reshape(BLOCK_N, BLOCK_K)
    if not F32:
        v = v * tl.full((1, 1), 2.0 ** 126, tl.bfloat16)
    v = v.reshape(BLOCK_N, BLOCK_K // 32, 32) * f[:, :, None]
    return v.reshape(BLOCK_N, BLOCK_K)



@triton.jit
def _dot_acc(acc, a, w, SWAP: tl.constexpr, F32: tl.constexpr):
    """acc + a @ w^T ([BM, BN]) or, SWAP, acc + w @ a ([BN, BM]; ``a`` given as [BK, BM]).
    F32: fp32 operands with an IEEE dot (fp32 activations, and the interpreter)."""
    # one return at the end: code after a constexpr-guarded early return is still compiled
    if F32:
        if SWAP:
            acc = tl.dot(w.to(tl.float32), a.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    else:
        if SWAP:  # noqa: SIM108 (a static branch: each side has its own shapes)
            acc = tl.dot(w.to(a.dtype), a, acc)
        else:
            acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc)
    return acc



@triton.jit
def _mx_acc(acc, a, w_rows, s_rows, kb, kg, kw, n_ok, K_BYTES, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, SWAP: tl.constexpr, F32: tl.constexpr, SCALED: tl.constexpr,
            WORDS: tl.constexpr):
    """acc + the product of activations ``a`` and the MXFP4 weight tile at byte columns ``kb``
    (layouts as :func:`_dot_acc`). SCALED: Triton's own microscaling dot (``tl.dot_scaled``,
    bf16 x e2m1 with the e8m0 scales; the compiler upcasts the weights where the GPU has no
    fp4 MMA); WORDS: ``w_rows`` point at int32 words, decoded at word columns ``kw`` straight to
    bf16 (:func:`_mxfp4_tile_words`); else the weights decoded here (:func:`_mxfp4_tile`)."""
    if SCALED:
        ok = n_ok[:, None] & (kb < K_BYTES)[None, :]
        wb = tl.load(w_rows + kb[None, :], mask=ok, other=0)  # [BN, BK/2] packed e2m1
        sc = tl.load(s_rows + kg[None, :], mask=n_ok[:, None] & (kg < K_BYTES // 16)[None, :],
                     other=127)  # [BN, BK/32] e8m0
        if SWAP:
            acc = tl.dot_scaled(wb, sc, "e2m1", a.to(tl.bfloat16), None, "bf16", acc)
        else:
            acc = tl.dot_scaled(a.to(tl.bfloat16), None, "bf16", tl.trans(wb), sc, "e2m1", acc)
    elif WORDS:
        acc = _dot_acc(acc, a, _mxfp4_tile_words(w_rows, s_rows, kw, kg, n_ok, K_BYTES // 4,
                                                 BLOCK_N, BLOCK_K, F32), SWAP, F32)
    else:
        acc = _dot_acc(acc, a, _mxfp4_tile(w_rows, s_rows, kb, kg, n_ok, K_BYTES, BLOCK_N, BLOCK_K),
                       SWAP, F32)
    return acc


def _as_words(w: torch.Tensor) -> torch.Tensor | None:
    """Packed MXFP4 bytes [E, N, K/2] as int32 words [E, N, K/8] (the same memory), or None
    where the layout does not allow it (rows not whole words, or not word-aligned)."""
    if (w.dtype != torch.uint8 or w.stride(-1) != 1 or w.shape[-1] % 4
            or w.storage_offset() % 4 or any(st % 4 for st in w.stride()[:-1])):
        return None
    return w.view(torch.int32)
