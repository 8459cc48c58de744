"""The quantized GEMMs' compile-check configurations: FP8 block-scaled linear (GEMM, GEMV and
split-K), the W8A8 prefill GEMM, and the MXFP4 MoE kernels at their decode and prefill tiles.
Data only, as ``_compile_specs``.
"""

from __future__ import annotations

from kernels import _fp8_linear_triton as fp8
from kernels import _fp8_w8a8_triton as w8a8
from kernels import _moe_sort_triton as msort
from kernels import _moe_split_k_triton as splitk
from kernels import _mxfp4_moe_gemv_triton as moe_gemv
from kernels import _mxfp4_moe_triton as moe
from kernels._kernel_spec import KernelSpec, ptr


def quantized_specs() -> list[KernelSpec]:
    """FP8 block-scaled linear and the MXFP4 MoE kernels at their decode and prefill tiles."""
    lin = {"x_ptr": ptr("bf16"), "w_ptr": ptr("u8"), "s_ptr": ptr("fp32"), "y_ptr": ptr("bf16")}
    # split-K: y_ptr is the fp32 partials, o_ptr the output, sem_ptr the int32 counters
    gemv = lin | {"y_ptr": ptr("fp32"), "o_ptr": ptr("bf16"), "sem_ptr": ptr("i32")}
    flags = {"TILE_SCALE": True, "F32": False}
    moe_ptrs = {"order_ptr": ptr("i64"), "row_end_ptr": ptr("i32"), "w_ptr": ptr("u8"),
                "s_ptr": ptr("u8"), "limit": "fp32"}
    gate_up = moe_ptrs | {"x_ptr": ptr("bf16"), "h_ptr": ptr("bf16")}
    down = moe_ptrs | {"h_ptr": ptr("bf16"), "tw_ptr": ptr("fp32"), "y_ptr": ptr("bf16")}
    w8a8_ptrs = {"xq_ptr": ptr("u8"), "xs_ptr": ptr("fp32"), "w_ptr": ptr("u8"),
                 "ws_ptr": ptr("fp32"), "y_ptr": ptr("bf16")}
    return [
        KernelSpec("fp8 linear decode (16x64x128)", fp8._fp8_linear_kernel, lin,
                   flags | {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128}),
        KernelSpec("fp8 linear decode narrow (16x16x128)", fp8._fp8_linear_kernel, lin,
                   flags | {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 128}),
        # the decode forms: dot (the default tiles unsplit, and split-K) and the no-dot sum form
        # at its narrowest and widest BLOCK_N, + the split-K reduce
        # (EVEN_K: K whole K-tiles, as every V4-Flash width; the masked form for the others)
        *(KernelSpec(f"fp8 gemv decode (16x32x128, unroll 2{'' if even else ', K masked'})",
                     fp8._fp8_gemv_kernel, gemv,
                     {"F32": False, "SPLIT": False, "SERIAL": False, "BLOCK_M": 16,
                      "BLOCK_N": 32, "BLOCK_K": 128, "UNROLL": 2, "EVEN_K": even},
                     num_stages=3) for even in (True, False)),
        *(KernelSpec(f"fp8 gemv decode split-K (16x64x128{', serial sum' if serial else ''})",
                     fp8._fp8_gemv_kernel, gemv,
                     {"F32": False, "SPLIT": True, "SERIAL": serial, "BLOCK_M": 16, "BLOCK_N": 64,
                      "BLOCK_K": 128, "UNROLL": 1, "EVEN_K": True},
                     num_stages=3) for serial in (False, True)),
        KernelSpec("fp8 gemv no-dot (4x128, unroll 4, 1 warp)", fp8._fp8_gemv_sum_kernel, gemv,
                   {"HW": True, "SPLIT": False, "SERIAL": False, "BLOCK_N": 4, "BLOCK_K": 128,
                    "UNROLL": 4}, num_warps=1, num_stages=3),
        *(KernelSpec(f"fp8 gemv no-dot split-K (16x128, unroll 2{', serial sum' if serial else ''})",
                     fp8._fp8_gemv_sum_kernel, gemv,
                     {"HW": True, "SPLIT": True, "SERIAL": serial, "BLOCK_N": 16, "BLOCK_K": 128,
                      "UNROLL": 2}, num_stages=3) for serial in (False, True)),
        KernelSpec("fp8 gemv split-K reduce", fp8._split_k_reduce_kernel,
                   {"p_ptr": ptr("fp32"), "y_ptr": ptr("bf16")}, {"BLOCK": 1024}),
        KernelSpec("fp8 linear prefill (64x128x128)", fp8._fp8_linear_kernel, lin,
                   flags | {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128}, num_warps=8),
        # the w8a8 prefill form at its CUDA tiles: 4 stages on sm_90, 3 on sm_120 (~100 KiB)
        # its activation quantizer, the GPU's e4m3 conversion (the integer one: interpreter)
        KernelSpec("fp8 w8a8 activation quant (32 x 128, hardware e4m3)", w8a8._act_quant_kernel,
                   {"x_ptr": ptr("bf16"), "q_ptr": ptr("u8"), "s_ptr": ptr("fp32")},
                   {"AMAX_FLOOR": 1e-10, "BLOCK_R": 32, "GROUP": 128, "HW": True}),
        # (V4-Flash's widths: whole K-tiles, one weight scale a tile; and the general form)
        *(KernelSpec(f"fp8 w8a8 prefill ({bm}x{bn}x128, {w} warps, {st} stages"
                     f"{'' if even else ', K masked, scales by row'})",
                     w8a8._fp8_w8a8_kernel, w8a8_ptrs,
                     {"HW": True, "GROUP_M": 8, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 128,
                      "EVEN_K": even, "ONE_SB": even},
                     num_warps=w, num_stages=st)
          for bm, bn, w, st, even in ((64, 128, 4, 4, True), (64, 128, 4, 3, True),
                                      (128, 128, 8, 3, True), (64, 128, 4, 3, False))),
        # the MoE GEMMs at their CUDA tiles (``moe_tiles``): decode, and prefill on each arch
        *(KernelSpec(f"mxfp4 moe {name} ({bm}x{bn}x{bk}, {w} warps, {st} stages"
                     f"{', swapped' if swap else ''}; 256 experts)", fn, ptrs,
                     {"F32": False, "E_P2": 256, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk,
                      "SWAP": swap, "PARTIAL" if fn is moe._moe_gate_up_kernel else "SPLIT": False},
                     num_warps=w, num_stages=st)
          for name, fn, ptrs in (("gate-up + swiglu", moe._moe_gate_up_kernel, gate_up),
                                 ("down", moe._moe_down_kernel, down))
          for bm, bn, bk, w, st, swap in ((16, 64, 128, 4, 3, True), (128, 128, 128, 8, 3, True),
                                          (128, 128, 128, 8, 2, True),
                                          (128, 128, 64, 8, 3, True),
                                          (128, 128, 64, 8, 3, False))),
        # the same with int32-word weights decoded straight to bf16 (tiles' 8th element), and
        # N-tiles first (the 9th: the prefill default)
        *(KernelSpec(f"mxfp4 moe {name} ({bm}x{bn}x{bk}, {w} warps, {st} stages, words"
                     f"{', swapped' if swap else ''}{', n-first' if nf else ''}; 256 experts)",
                     fn, ptrs | {"w_ptr": ptr("i32")},
                     {"F32": False, "E_P2": 256, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk,
                      "SWAP": swap, "WORDS": True, "N_FIRST": nf,
                      "PARTIAL" if fn is moe._moe_gate_up_kernel else "SPLIT": False},
                     num_warps=w, num_stages=st)
          for name, fn, ptrs in (("gate-up + swiglu", moe._moe_gate_up_kernel, gate_up),
                                 ("down", moe._moe_down_kernel, down))
          for bm, bn, bk, w, st, swap, nf in ((128, 128, 128, 8, 3, True, True),
                                              (128, 128, 128, 8, 4, True, True),
                                              (256, 64, 128, 8, 3, True, True),
                                              (128, 128, 128, 8, 3, False, True),
                                              (128, 128, 64, 8, 3, False, False))),
        # the per-pair GEMV form (BLOCK_M 1), the decode default up to 64 pairs
        # (int32 words: the default; bytes: the earlier decode, a sweep option)
        *(KernelSpec(f"mxfp4 moe gemv gate-up + swiglu (16x256, 4 warps, {wn})",
                     moe_gemv._moe_gemv_gate_up_kernel,
                     {"x_ptr": ptr("bf16"), "ids_ptr": ptr("i64"), "w_ptr": ptr(wt),
                      "s_ptr": ptr("u8"), "h_ptr": ptr("bf16"), "limit": "fp32"},
                     {"PARTIAL": False, "BLOCK_N": 16, "BLOCK_K": 256, "WORDS": words},
                     num_warps=4, num_stages=3)
          for wn, wt, words in (("words", "i32", True), ("bytes", "u8", False))),
        *(KernelSpec(f"mxfp4 moe gemv down (16x256, 4 warps, {wn})", moe_gemv._moe_gemv_down_kernel,
                     {"h_ptr": ptr("bf16"), "ids_ptr": ptr("i64"), "tw_ptr": ptr("fp32"),
                      "w_ptr": ptr(wt), "s_ptr": ptr("u8"), "y_ptr": ptr("bf16")},
                     {"SPLIT": False, "BLOCK_N": 16, "BLOCK_K": 256, "WORDS": words},
                     num_warps=4, num_stages=3)
          for wn, wt, words in (("words", "i32", True), ("bytes", "u8", False))),
        # the tl.dot_scaled form (tiles' 7th element), both operand orders
        *(KernelSpec(f"mxfp4 moe {name} ({bm}x{bn}x{bk}, dot_scaled{', swapped' if swap else ''})",
                     fn, ptrs, {"F32": False, "E_P2": 256, "BLOCK_M": bm, "BLOCK_N": bn,
                                "BLOCK_K": bk, "SWAP": swap, "SCALED": True},
                     num_warps=w, num_stages=3)
          for name, fn, ptrs in (("gate-up + swiglu", moe._moe_gate_up_kernel, gate_up),
                                 ("down", moe._moe_down_kernel, down))
          for bm, bn, bk, w, swap in ((16, 64, 128, 4, True), (128, 128, 128, 8, True),
                                      (128, 128, 128, 8, False))),
        KernelSpec("moe tiled sort: count (256 experts)", msort._tile_count_kernel,
                   {"ids_ptr": ptr("i64"), "counts_ptr": ptr("i32")},
                   {"TILE": msort.SORT_TILE, "EB": 128}),
        KernelSpec("moe tiled sort: scan", msort._tile_scan_kernel, {"counts_ptr": ptr("i32")},
                   {"EB": 32, "TB": 64}),
        KernelSpec("moe tiled sort: order (256 experts)", msort._tile_order_kernel,
                   {"ids_ptr": ptr("i64"), "counts_ptr": ptr("i32"), "row_end_ptr": ptr("i32"),
                    "order_ptr": ptr("i64")}, {"TILE": msort.SORT_TILE, "E_P2": 256}),
        # the decode split-K forms: gate-up and down writing fp32 partials, the SwiGLU epilogue
        # that sums them, and the combine summing the down partials
        KernelSpec("mxfp4 moe gate-up decode split-K partials", moe._moe_gate_up_kernel,
                   gate_up | {"h_ptr": ptr("fp32")},
                   {"F32": False, "E_P2": 256, "PARTIAL": True, "BLOCK_M": 16, "BLOCK_N": 64,
                    "BLOCK_K": 128, "SWAP": True}, num_stages=3),
        KernelSpec("mxfp4 moe down decode split-K partials", moe._moe_down_kernel,
                   down | {"y_ptr": ptr("fp32")},
                   {"F32": False, "E_P2": 256, "SPLIT": True, "BLOCK_M": 16, "BLOCK_N": 64,
                    "BLOCK_K": 128, "SWAP": True}, num_stages=3),
        KernelSpec("moe split-K swiglu epilogue (2048)", splitk._moe_swiglu_split_kernel,
                   {"p_ptr": ptr("fp32"), "h_ptr": ptr("bf16"), "limit": "fp32"},
                   {"BLOCK": 1024}),
        KernelSpec("moe combine split-K partials (4096)", splitk._moe_combine_kernel,
                   {"y_ptr": ptr("fp32"), "out_ptr": ptr("bf16")},
                   {"ACCUMULATE": True, "BLOCK": 1024}),
        KernelSpec("moe combine (4096)", splitk._moe_combine_kernel,
                   {"y_ptr": ptr("bf16"), "out_ptr": ptr("bf16")},
                   {"ACCUMULATE": True, "BLOCK": 1024}),
    ]


