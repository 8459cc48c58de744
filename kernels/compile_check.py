"""``python -m kernels.compile_check``: compile every Triton kernel for an H100/H200 (sm_90) on a
machine without a GPU, and report shared memory, registers and spills. ``--records FILE``:
compile instead the launches a :class:`LaunchRecorder` saw under the interpreter (what the
engine really passed; ``lab.bench.deepseek_v4.count_launches --record FILE`` writes one).
Kernels that take a ``PDL`` constexpr (programmatic dependent launch, kernels/NOTES.md) are
compiled with it on as well (every default spec of theirs twice, each record with it on unless
``--no-pdl``), and their PTX must wait on the grid dependency before any global memory access.

Catches what the CPU interpreter cannot (non-constexpr globals, shapes the GPU backend rejects,
register spills) before any GPU time is spent. Pointer arguments and strides are declared
16-divisible, as Triton specialises them at a real launch; without that its software pipeliner
stays off and the report would describe different code. Needs a triton with the NVIDIA backend
(the PyPI wheel has it). Diagnostic only: the engine never imports it (lab.bench.deepseek_v4.count_launches does, for
its LaunchRecorder), and it never runs a kernel.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field, replace

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import _compress_decode_triton as comp
from kernels import _fp8_linear_triton as fp8
from kernels import _fp8_w8a8_triton as w8a8
from kernels import _fused_triton as fused
from kernels import _hc_decode_triton as hcd
from kernels import _hc_streams_triton as hcs
from kernels import _indexer_decode_triton as idxd
from kernels import _indexer_triton as idx
from kernels import _moe_decode_triton as moed
from kernels import _moe_sort_triton as msort
from kernels import _mxfp4_moe_triton as moe
from kernels import _paged_attention_triton as paged
from kernels import _rope_norm_triton as rn
from kernels import _sinkhorn_triton as sk
from kernels import _sparse_attention_triton as sparse
from kernels._launch_configs import launch_config
from kernels._triton_support import PDL_PREFETCH, PDL_TRIGGER, PDL_WAIT

_DIV16_INTS = {"num_heads", "head_dim", "num_q_heads"}


@dataclass(frozen=True)
class KernelSpec:
    name: str
    fn: object  # a triton JITFunction
    types: dict[str, str]  # argument -> triton type ("*bf16", "fp32", ...); others are i32
    constexprs: dict[str, object]
    num_warps: int = 4
    num_stages: int = 2


@dataclass
class CompileResult:
    name: str
    ok: bool
    shared_bytes: int = 0
    registers: int | None = None
    spill_bytes: int | None = None
    uses_wgmma: bool = False
    error: str = ""
    notes: list[str] = field(default_factory=list)


def _ptr(dtype: str) -> str:
    return "*" + dtype


def default_specs() -> list[KernelSpec]:
    """The configurations the wrappers launch by default (bf16 unless stated)."""
    scores_types = {"q_ptr": _ptr("bf16"), "k_ptr": _ptr("bf16"), "w_ptr": _ptr("fp32"),
                    "kv_end_ptr": _ptr("i32"), "scores_ptr": _ptr("fp32"),
                    "q_scale_ptr": _ptr("fp32"), "k_scale_ptr": _ptr("fp32")}
    fp8_types = scores_types | {"q_ptr": _ptr("fp8e4nv"), "k_ptr": _ptr("fp8e4nv")}
    tile = {"UPCAST": False, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_D": 128}
    sparse_types = {n: _ptr("bf16") for n in ("q_ptr", "out_ptr", "wkv_ptr", "ckv_ptr")}
    sparse_types |= {n: _ptr("i32") for n in ("wstart_ptr", "wend_ptr", "bt_ptr", "rowseq_ptr",
                                               "idx_ptr", "cstart_ptr", "cend_ptr")}
    sparse_types |= {"sink_ptr": _ptr("fp32"), "qk_scale": "fp32",
                     "part_acc_ptr": _ptr("fp32"), "part_ml_ptr": _ptr("fp32")}
    sparse_flags = {"PAGE_SIZE": 1, "PAGED": False, "HAS_IDX": True, "HAS_RANGE": True,
                    "HAS_SINK": True, "UPCAST": False, "SPLIT": False, "BLOCK_D": 512}
    kv_types = {n: _ptr("bf16") for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
    prefill_types = kv_types | {n: _ptr("i32") for n in ("bt_ptr", "qsl_ptr", "ctx_ptr")}
    prefill_types["qk_scale"] = "fp32"
    mixes = {"s_ptr": _ptr("bf16"), "fn_ptr": _ptr("fp32"), "out_ptr": _ptr("fp32"), "eps": "fp32"}
    fp8_kv = {"k_ptr": _ptr("fp8e4nv"), "v_ptr": _ptr("fp8e4nv")}  # kv_dtype=fp8
    decode_types = kv_types | {"part_acc_ptr": _ptr("fp32"), "part_ml_ptr": _ptr("fp32"),
                               "bt_ptr": _ptr("i32"), "ctx_ptr": _ptr("i32"), "qk_scale": "fp32"}
    return [
        KernelSpec("indexer scores bf16", idx._indexer_scores_kernel, scores_types,
                   {"HAS_Q_SCALE": False, "HAS_K_SCALE": False, **tile}),
        KernelSpec("indexer scores fp8", idx._indexer_scores_kernel, fp8_types,
                   {"HAS_Q_SCALE": True, "HAS_K_SCALE": True, **tile}),
        KernelSpec("indexer merge top-512", idx._topk_merge_kernel,
                   {"scores_ptr": _ptr("fp32"), "kv_end_ptr": _ptr("i32"),
                    "best_ptr": _ptr("i64"), "cand_ptr": _ptr("i64")},
                   {"KP": 512, "LOG_KP": 9}),
        KernelSpec("indexer merge top-512 (decode: int64 kv_end, 4 parts, 8 warps)",
                   idx._topk_merge_kernel,
                   {"scores_ptr": _ptr("fp32"), "kv_end_ptr": _ptr("i64"),
                    "best_ptr": _ptr("i64"), "cand_ptr": _ptr("i64")},
                   {"KP": 512, "LOG_KP": 9, "PARTS": 4}, num_warps=8),
        KernelSpec("indexer combine 4 parts' top-512", idx._topk_combine_kernel,
                   {"best_ptr": _ptr("i64"), "out_ptr": _ptr("i64")},
                   {"KP": 512, "LOG_KP": 9, "PARTS": 4}, num_warps=8),
        KernelSpec("indexer merge top-2048", idx._topk_merge_kernel,
                   {"scores_ptr": _ptr("fp32"), "kv_end_ptr": _ptr("i32"),
                    "best_ptr": _ptr("i64"), "cand_ptr": _ptr("i64")},
                   {"KP": 2048, "LOG_KP": 11}),
        KernelSpec("indexer init", idx._topk_init_kernel, {"best_ptr": _ptr("i64")}, {"KP": 512}),
        KernelSpec("indexer finalize", idx._topk_finalize_kernel,
                   {"best_ptr": _ptr("i64"), "out_scores_ptr": _ptr("fp32"),
                    "out_idx_ptr": _ptr("i32")}, {"KP": 512}),
        KernelSpec("sparse prefill (64 heads)", sparse._sparse_attention_kernel, sparse_types,
                   sparse_flags | {"BLOCK_H": 64, "BLOCK_N": 32}, num_warps=8),
        KernelSpec("sparse decode (16 heads)", sparse._sparse_attention_kernel, sparse_types,
                   sparse_flags | {"BLOCK_H": 16, "BLOCK_N": 64}, num_warps=4),
        KernelSpec("sparse paged window", sparse._sparse_attention_kernel, sparse_types,
                   sparse_flags | {"PAGE_SIZE": 16, "PAGED": True, "BLOCK_H": 16,
                                   "BLOCK_N": 64}, num_warps=4),
        KernelSpec("sparse decode split", sparse._sparse_attention_kernel, sparse_types,
                   sparse_flags | {"SPLIT": True, "BLOCK_H": 16, "BLOCK_N": 64}, num_warps=4),
        KernelSpec("sparse split combine", sparse._sparse_combine_kernel,
                   {"part_acc_ptr": _ptr("fp32"), "part_ml_ptr": _ptr("fp32"),
                    "out_ptr": _ptr("bf16"), "sink_ptr": _ptr("fp32")},
                   {"HAS_SINK": True, "BLOCK_S": 8, "BLOCK_D": 512}),
        KernelSpec("paged prefill", paged._paged_attention_kernel, prefill_types,
                   {"PAGE_SIZE": 16, "UPCAST": False, "BLOCK_M": 128, "BLOCK_N": 64,
                    "BLOCK_D": 128}, num_warps=8),
        KernelSpec("paged decode split", paged._paged_decode_kernel, decode_types,
                   {"PAGE_SIZE": 16, "UPCAST": False, "SPLIT": True, "BLOCK_G": 16,
                    "BLOCK_N": 64, "BLOCK_D": 128}),
        KernelSpec("paged prefill, fp8 kv", paged._paged_attention_kernel,
                   prefill_types | fp8_kv,
                   {"PAGE_SIZE": 16, "UPCAST": False, "BLOCK_M": 128, "BLOCK_N": 64,
                    "BLOCK_D": 128}, num_warps=8),
        KernelSpec("paged decode split, fp8 kv", paged._paged_decode_kernel,
                   decode_types | fp8_kv,
                   {"PAGE_SIZE": 16, "UPCAST": False, "SPLIT": True, "BLOCK_G": 16,
                    "BLOCK_N": 64, "BLOCK_D": 128}),
        KernelSpec("paged decode combine", paged._paged_decode_combine_kernel,
                   {"part_acc_ptr": _ptr("fp32"), "part_ml_ptr": _ptr("fp32"),
                    "out_ptr": _ptr("bf16")}, {"BLOCK_S": 32, "BLOCK_D": 128}),
        KernelSpec("fused add + rms norm (4096)", fused._add_rms_norm_kernel,
                   {"x_ptr": _ptr("bf16"), "res_ptr": _ptr("bf16"), "w_ptr": _ptr("bf16"),
                    "out_ptr": _ptr("bf16"), "eps": "fp32"},
                   {"HAS_RES": True, "BLOCK": 4096}, num_warps=16),
        KernelSpec("fused rope + kv write (d 128)", fused._rope_and_cache_kernel,
                   {p: _ptr("bf16") for p in ("q_ptr", "k_ptr", "v_ptr", "cos_ptr", "sin_ptr",
                                               "kc_ptr", "vc_ptr", "qo_ptr")}
                   | {"pos_ptr": _ptr("i64"), "slot_ptr": _ptr("i64")},
                   {"NUM_Q_HEADS": 32, "HALF": 64, "BLOCK_HALF": 64, "KV_FP8": False},
                   num_warps=1),
        KernelSpec("fused rope + fp8 kv write (d 128)", fused._rope_and_cache_kernel,
                   {p: _ptr("bf16") for p in ("q_ptr", "k_ptr", "v_ptr", "cos_ptr", "sin_ptr",
                                               "qo_ptr")}
                   | {"kc_ptr": _ptr("fp8e4nv"), "vc_ptr": _ptr("fp8e4nv"),
                      "pos_ptr": _ptr("i64"), "slot_ptr": _ptr("i64")},
                   {"NUM_Q_HEADS": 32, "HALF": 64, "BLOCK_HALF": 64, "KV_FP8": True},
                   num_warps=1),
        KernelSpec("mHC sinkhorn (m 4)", sk._sinkhorn_kernel,
                   {"x_ptr": _ptr("fp32"), "out_ptr": _ptr("fp32"), "eps": "fp32"},
                   {"BLOCK": 4}, num_warps=1),
        KernelSpec("mHC mixes (prefill, 24 rows)", hcs._hc_mixes_kernel, mixes,
                   {"BLOCK_N": hcs.HC_MIX_BLOCK_N, "BLOCK_R": 32, "BLOCK_K": hcs.HC_MIX_BLOCK_K}),
        KernelSpec("mHC mixes (prefill, 24 rows, bf16 streams: 3-part bf16 dots)",
                   hcs._hc_mixes_kernel, mixes | {"s_ptr": _ptr("bf16")},
                   {"BLOCK_N": hcs.HC_MIX_BLOCK_N, "BLOCK_R": 32, "BLOCK_K": hcs.HC_MIX_BLOCK_K,
                    "SPLIT3": True}, num_stages=3),
        KernelSpec("mHC mixes (prefill from 4096 tokens, 24 rows, bf16 streams: 3-part bf16 dots)",
                   hcs._hc_mixes_kernel, mixes | {"s_ptr": _ptr("bf16")},
                   {"BLOCK_N": hcs.HC_MIX_BLOCK_N_WIDE, "BLOCK_R": 32,
                    "BLOCK_K": hcs.HC_MIX_BLOCK_K, "SPLIT3": True}, num_stages=3),
        KernelSpec("mHC merge (prefill, bf16 streams)", hcs._hc_merge_kernel,
                   {"post_ptr": _ptr("fp32"), "comb_ptr": _ptr("fp32"), "bo_ptr": _ptr("bf16"),
                    "s_ptr": _ptr("bf16"), "out_ptr": _ptr("bf16")},
                   {"BLOCK_M": 4, "BLOCK_D": hcs.HC_BLOCK_D, "F32": False}),
        KernelSpec("mHC collapse (prefill, bf16 streams)", hcs._hc_collapse_kernel,
                   {"pre_ptr": _ptr("fp32"), "s_ptr": _ptr("bf16"), "out_ptr": _ptr("bf16")},
                   {"BLOCK_M": 4, "BLOCK_D": hcs.HC_BLOCK_D}),
        KernelSpec("mHC mixes (prefill, head)", hcs._hc_mixes_kernel, mixes,
                   {"BLOCK_N": hcs.HC_MIX_BLOCK_N, "BLOCK_R": 16, "BLOCK_K": hcs.HC_MIX_BLOCK_K}),
        KernelSpec("fused silu * up", fused._silu_and_mul_kernel,
                   {"g_ptr": _ptr("bf16"), "u_ptr": _ptr("bf16"), "out_ptr": _ptr("bf16")},
                   {"BLOCK": 1024}),
        *_quantized_specs(),
        *_decode_specs(),
    ]


PDL_ALL = PDL_WAIT | PDL_TRIGGER | PDL_PREFETCH


def takes_pdl(fn: object) -> bool:
    """Whether a kernel has the ``PDL`` constexpr (launched with ``launch_pdl`` on sm_90+)."""
    return "PDL" in inspect.signature(fn.fn).parameters  # type: ignore[attr-defined]


def with_pdl(specs: list[KernelSpec]) -> list[KernelSpec]:
    """``specs`` and, after them, each spec of a kernel that takes ``PDL`` with every bit of it
    on (wait, trigger, prefetch: the code of any other mode is a subset)."""
    return specs + [replace(s, name=f"{s.name} [PDL]", constexprs=s.constexprs | {"PDL": PDL_ALL})
                    for s in specs if takes_pdl(s.fn) and "PDL" not in s.constexprs]


def _decode_specs() -> list[KernelSpec]:
    """The DeepSeek-V4 decode step's fused kernels (engine/models/deepseek_v4/decode_fused.py)
    at V4-Flash's widths, every compile-time branch the engine takes."""
    hc = {"s_ptr": _ptr("bf16"), "fn_ptr": _ptr("fp32"), "part_ptr": _ptr("fp32"),
          "post_ptr": _ptr("fp32"), "comb_ptr": _ptr("fp32"), "bo_ptr": _ptr("bf16"),
          "out_ptr": _ptr("bf16")}
    fin = {"part_ptr": _ptr("fp32"), "s_ptr": _ptr("bf16"), "base_ptr": _ptr("fp32"),
           "scale_ptr": _ptr("fp32"), "post_ptr": _ptr("fp32"), "comb_ptr": _ptr("fp32"),
           "x_ptr": _ptr("bf16"), "hc_eps": "fp32", "norm_eps": "fp32"}
    rope = {"x_ptr": _ptr("bf16"), "cos_ptr": _ptr("bf16"), "sin_ptr": _ptr("bf16"),
            "w_ptr": _ptr("fp32"), "src_ptr": _ptr("i64"), "dst_ptr": _ptr("i64"),
            "out_ptr": _ptr("bf16"), "eps": "fp32"}
    idx64 = {p: _ptr("i64") for p in ("wr_ptr", "slot_ptr", "pos_ptr", "tab_ptr", "dst_ptr")}
    cw = launch_config("compress_window", 1, 128)  # the batch-1 decode settings (HCA)
    cs = launch_config("compress_window", 1, 8)  # (CSA: a window of two series of 4)
    rc = launch_config("moe_router", 1)
    window = idx64 | {"kv_ptr": _ptr("bf16"), "g_ptr": _ptr("bf16"), "bkv_ptr": _ptr("bf16"),
                      "bg_ptr": _ptr("bf16"), "pb_ptr": _ptr("fp32"), "okv_ptr": _ptr("bf16"),
                      "og_ptr": _ptr("fp32"), "ent_ptr": _ptr("bf16")}
    entry = idx64 | {"ent_ptr": _ptr("bf16"), "w_ptr": _ptr("fp32"), "freq_ptr": _ptr("fp32"),
                     "out_ptr": _ptr("bf16"), "pool_ptr": _ptr("bf16"), "eps": "fp32",
                     "rope_scale": "fp32"}
    route = {"lg_ptr": _ptr("bf16"), "bias_ptr": _ptr("fp32"), "hash_ptr": _ptr("i64"),
             "tok_ptr": _ptr("i64"), "w_ptr": _ptr("fp32"), "idx_ptr": _ptr("i64"),
             "scaling": "fp32"}
    mix = {"F32": False, "BLOCK_M": 4, "BLOCK_R": 32, "BLOCK_D": hcd.HC_MIX_BLOCK_D}
    return [
        KernelSpec("hc_decode merge + mix", hcd._hc_mix_kernel, hc, mix | {"MERGE": True}),
        KernelSpec("hc_decode merge + mix (2 warps)", hcd._hc_mix_kernel, hc,
                   mix | {"MERGE": True}, num_warps=2),
        KernelSpec("hc_decode mix (first layer)", hcd._hc_mix_kernel, hc, mix | {"MERGE": False}),
        KernelSpec("hc_decode finish (Sinkhorn, 1 warp)", hcd._hc_finish_kernel, fin,
                   {"HEAD": False, "BLOCK_M": 4, "BLOCK_S": 64, "BLOCK_D": hcd.HC_MIX_BLOCK_D},
                   num_warps=1),
        KernelSpec("hc_decode finish (head, 1 warp)", hcd._hc_finish_kernel, fin,
                   {"HEAD": True, "BLOCK_M": 4, "BLOCK_S": 64, "BLOCK_D": hcd.HC_MIX_BLOCK_D},
                   num_warps=1),
        KernelSpec("hc_decode norm", hcd._hc_norm_kernel,
                   {"part_ptr": _ptr("fp32"), "w_ptr": _ptr("fp32"), "x_ptr": _ptr("bf16"),
                    "norm_eps": "fp32"}, {"BLOCK_S": 64, "BLOCK_D": hcd.HC_MIX_BLOCK_D}),
        KernelSpec("hc_decode norm (1 warp)", hcd._hc_norm_kernel,
                   {"part_ptr": _ptr("fp32"), "w_ptr": _ptr("fp32"), "x_ptr": _ptr("bf16"),
                    "norm_eps": "fp32"}, {"BLOCK_S": 64, "BLOCK_D": hcd.HC_MIX_BLOCK_D},
                   num_warps=1),
        KernelSpec("rope_norm q (norm + rope, in place)", rn._rope_norm_kernel, rope,
                   {"NORM": True, "WEIGHT": False, "SRC": False, "DST": False, "BLOCK_D": 512,
                    "BLOCK_R": 32}),
        KernelSpec("rope_norm kv -> window ring", rn._rope_norm_kernel, rope,
                   {"NORM": True, "WEIGHT": True, "SRC": True, "DST": True, "BLOCK_D": 512,
                    "BLOCK_R": 32}),
        KernelSpec("rope_norm inverse rope", rn._rope_norm_kernel, rope,
                   {"NORM": False, "WEIGHT": False, "SRC": False, "DST": False,
                    "BLOCK_D": 512, "BLOCK_R": 32}),
        KernelSpec("compress window (CSA overlap)", comp._compress_window_kernel, window,
                   {"OVERLAP": True, "BLOCK_C": cs["BLOCK_C"], "BLOCK_W": 8},
                   num_warps=cs["num_warps"]),
        KernelSpec("compress window (HCA)", comp._compress_window_kernel, window,
                   {"OVERLAP": False, "BLOCK_C": cw["BLOCK_C"],
                    "BLOCK_W": min(cw["BLOCK_W"], 128)}, num_warps=cw["num_warps"]),
        KernelSpec("compress entry (d 512)", comp._compress_entry_kernel, entry,
                   {"BLOCK_D": 512, "BLOCK_R": 32}),
        KernelSpec("compress entry (d 512, into the pool)", comp._compress_entry_kernel, entry,
                   {"BLOCK_D": 512, "BLOCK_R": 32, "POOL": True}),
        KernelSpec("moe route (sqrt-softplus, 256 experts)", moed._moe_route_kernel, route,
                   {"SCORING": 0, "HASH": False, "BLOCK_E": 256, "BLOCK_K": 8}),
        KernelSpec("moe route (hash)", moed._moe_route_kernel, route,
                   {"SCORING": 0, "HASH": True, "BLOCK_E": 256, "BLOCK_K": 8}),
        KernelSpec("moe router (linear + route, 256 experts)", moed._moe_router_kernel,
                   route | {"x_ptr": _ptr("bf16"), "gw_ptr": _ptr("bf16"), "sem_ptr": _ptr("i32")},
                   {"SCORING": 0, "HASH": False, "BLOCK_G": rc["BLOCK_G"],
                    "BLOCK_H": rc["BLOCK_H"], "BLOCK_E": 256, "BLOCK_K": 8},
                   num_warps=rc["num_warps"]),
        KernelSpec("indexer decode scores (64 x 128)", idxd._indexer_decode_kernel,
                   {"q_ptr": _ptr("bf16"), "w_ptr": _ptr("fp32"), "k_ptr": _ptr("bf16"),
                    "tab_ptr": _ptr("i64"), "end_ptr": _ptr("i64"), "out_ptr": _ptr("fp32")},
                   {"F32": False, "BLOCK_H": 64, "BLOCK_D": 128,
                    "BLOCK_T": idxd.INDEXER_DECODE_BLOCK_T}, num_warps=8),
        KernelSpec("indexer decode top-512 -> pool rows", idxd._topk_rows_finalize_kernel,
                   {"best_ptr": _ptr("i64"), "tab_ptr": _ptr("i64"), "out_ptr": _ptr("i32")},
                   {"KP": 512}),
        KernelSpec("clamped swiglu", moed._clamped_swiglu_kernel,
                   {"g_ptr": _ptr("bf16"), "u_ptr": _ptr("bf16"), "out_ptr": _ptr("bf16"),
                    "limit": "fp32"}, {"BLOCK": 1024}),
    ]


def _quantized_specs() -> list[KernelSpec]:
    """FP8 block-scaled linear and the MXFP4 MoE kernels at their decode and prefill tiles."""
    lin = {"x_ptr": _ptr("bf16"), "w_ptr": _ptr("u8"), "s_ptr": _ptr("fp32"), "y_ptr": _ptr("bf16")}
    # split-K: y_ptr is the fp32 partials, o_ptr the output, sem_ptr the int32 counters
    gemv = lin | {"y_ptr": _ptr("fp32"), "o_ptr": _ptr("bf16"), "sem_ptr": _ptr("i32")}
    flags = {"TILE_SCALE": True, "F32": False}
    moe_ptrs = {"order_ptr": _ptr("i64"), "row_end_ptr": _ptr("i32"), "w_ptr": _ptr("u8"),
                "s_ptr": _ptr("u8"), "limit": "fp32"}
    gate_up = moe_ptrs | {"x_ptr": _ptr("bf16"), "h_ptr": _ptr("bf16")}
    down = moe_ptrs | {"h_ptr": _ptr("bf16"), "tw_ptr": _ptr("fp32"), "y_ptr": _ptr("bf16")}
    w8a8_ptrs = {"xq_ptr": _ptr("u8"), "xs_ptr": _ptr("fp32"), "w_ptr": _ptr("u8"),
                 "ws_ptr": _ptr("fp32"), "y_ptr": _ptr("bf16")}
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
                   {"p_ptr": _ptr("fp32"), "y_ptr": _ptr("bf16")}, {"BLOCK": 1024}),
        KernelSpec("fp8 linear prefill (64x128x128)", fp8._fp8_linear_kernel, lin,
                   flags | {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128}, num_warps=8),
        # the w8a8 prefill form at its CUDA tiles: 4 stages on sm_90, 3 on sm_120 (~100 KiB)
        # its activation quantizer, the GPU's e4m3 conversion (the integer one: interpreter)
        KernelSpec("fp8 w8a8 activation quant (32 x 128, hardware e4m3)", w8a8._act_quant_kernel,
                   {"x_ptr": _ptr("bf16"), "q_ptr": _ptr("u8"), "s_ptr": _ptr("fp32")},
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
                     fn, ptrs | {"w_ptr": _ptr("i32")},
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
                     moe._moe_gemv_gate_up_kernel,
                     {"x_ptr": _ptr("bf16"), "ids_ptr": _ptr("i64"), "w_ptr": _ptr(wt),
                      "s_ptr": _ptr("u8"), "h_ptr": _ptr("bf16"), "limit": "fp32"},
                     {"PARTIAL": False, "BLOCK_N": 16, "BLOCK_K": 256, "WORDS": words},
                     num_warps=4, num_stages=3)
          for wn, wt, words in (("words", "i32", True), ("bytes", "u8", False))),
        *(KernelSpec(f"mxfp4 moe gemv down (16x256, 4 warps, {wn})", moe._moe_gemv_down_kernel,
                     {"h_ptr": _ptr("bf16"), "ids_ptr": _ptr("i64"), "tw_ptr": _ptr("fp32"),
                      "w_ptr": _ptr(wt), "s_ptr": _ptr("u8"), "y_ptr": _ptr("bf16")},
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
                   {"ids_ptr": _ptr("i64"), "counts_ptr": _ptr("i32")},
                   {"TILE": msort.SORT_TILE, "EB": 128}),
        KernelSpec("moe tiled sort: scan", msort._tile_scan_kernel, {"counts_ptr": _ptr("i32")},
                   {"EB": 32, "TB": 64}),
        KernelSpec("moe tiled sort: order (256 experts)", msort._tile_order_kernel,
                   {"ids_ptr": _ptr("i64"), "counts_ptr": _ptr("i32"), "row_end_ptr": _ptr("i32"),
                    "order_ptr": _ptr("i64")}, {"TILE": msort.SORT_TILE, "E_P2": 256}),
        # the decode split-K forms: gate-up and down writing fp32 partials, the SwiGLU epilogue
        # that sums them, and the combine summing the down partials
        KernelSpec("mxfp4 moe gate-up decode split-K partials", moe._moe_gate_up_kernel,
                   gate_up | {"h_ptr": _ptr("fp32")},
                   {"F32": False, "E_P2": 256, "PARTIAL": True, "BLOCK_M": 16, "BLOCK_N": 64,
                    "BLOCK_K": 128, "SWAP": True}, num_stages=3),
        KernelSpec("mxfp4 moe down decode split-K partials", moe._moe_down_kernel,
                   down | {"y_ptr": _ptr("fp32")},
                   {"F32": False, "E_P2": 256, "SPLIT": True, "BLOCK_M": 16, "BLOCK_N": 64,
                    "BLOCK_K": 128, "SWAP": True}, num_stages=3),
        KernelSpec("moe split-K swiglu epilogue (2048)", moe._moe_swiglu_split_kernel,
                   {"p_ptr": _ptr("fp32"), "h_ptr": _ptr("bf16"), "limit": "fp32"},
                   {"BLOCK": 1024}),
        KernelSpec("moe combine split-K partials (4096)", moe._moe_combine_kernel,
                   {"y_ptr": _ptr("fp32"), "out_ptr": _ptr("bf16")},
                   {"ACCUMULATE": True, "BLOCK": 1024}),
        KernelSpec("moe combine (4096)", moe._moe_combine_kernel,
                   {"y_ptr": _ptr("bf16"), "out_ptr": _ptr("bf16")},
                   {"ACCUMULATE": True, "BLOCK": 1024}),
    ]


# a global load, store or atomic, or an async copy (predicated or not) in PTX; not an L2 bulk
# prefetch (``l2_prefetch``: loads nothing into the program, asked only for weights)
_GLOBAL_ACCESS = re.compile(r"^\s*(?:@!?%p\d+\s+)?(?:ld\.global|st\.global|atom\.|red\.|"
                            r"cp\.async(?!\.bulk\.prefetch)|cp\.reduce\.async)", re.M)


def pdl_wait_problem(ptx: str) -> str:
    """'' when the PTX waits on the grid dependency (``griddepcontrol.wait``) before its first
    global load, store or atomic (a PDL launch may start before the previous kernel's writes
    are visible); else what is wrong."""
    wait = ptx.find("griddepcontrol.wait")
    if wait < 0:
        return "PDL on but no griddepcontrol.wait in the PTX"
    first = _GLOBAL_ACCESS.search(ptx)
    if first is not None and first.start() < wait:
        line = ptx[first.start():ptx.find("\n", first.start() + 1)].strip()
        return f"PDL on but global memory is accessed before griddepcontrol.wait: {line}"
    return ""


def _ptxas() -> str | None:
    base = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for name in ("ptxas-blackwell", "ptxas"):  # the newer one reads the newer PTX
        path = os.path.join(base, name)
        if os.path.exists(path):
            return path
    return None


def _ptx_resources(ptx: str, ptxas: str) -> tuple[int | None, int | None]:
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        proc = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "k.o")],
                              capture_output=True, text=True, check=False)
    regs = re.search(r"Used (\d+) registers", proc.stderr)
    spills = re.search(r"(\d+) bytes spill stores", proc.stderr)
    return (int(regs.group(1)) if regs else None, int(spills.group(1)) if spills else None)


def compile_one(spec: KernelSpec, target: GPUTarget) -> CompileResult:
    sig = inspect.signature(spec.fn.fn)  # type: ignore[attr-defined]
    params = list(sig.parameters)
    # constexpr parameters the spec leaves out take their defaults, as a launch would
    given = {p: v.default for p, v in sig.parameters.items()
             if v.default is not inspect.Parameter.empty and "constexpr" in str(v.annotation)}
    given.update(spec.constexprs)
    signature = {p: "constexpr" if p in given else spec.types.get(p, "i32") for p in params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params)
             if signature[p].startswith("*") or p.startswith("stride") or p in _DIV16_INTS}
    constexprs = {(params.index(k),): v for k, v in given.items()}
    pdl = bool(given.get("PDL"))
    options: dict[str, object] = {"num_warps": spec.num_warps, "num_stages": spec.num_stages}
    if pdl:
        options["launch_pdl"] = True
    try:
        kernel = triton.compile(ASTSource(fn=spec.fn, signature=signature, constexprs=constexprs,
                                          attrs=attrs),
                                target=target, options=options)
    except Exception as exc:  # report every kernel, not just the first failure
        return CompileResult(spec.name, ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
    result = CompileResult(spec.name, ok=True, shared_bytes=int(kernel.metadata.shared),
                           uses_wgmma="wgmma" in kernel.asm["ptx"])
    if pdl and (problem := pdl_wait_problem(kernel.asm["ptx"])):
        result.ok, result.error = False, problem
    ptxas = _ptxas()
    if ptxas and target.arch == 90:
        result.registers, result.spill_bytes = _ptx_resources(kernel.asm["ptx"], ptxas)
    return result


_TORCH_TYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "int64": "i64",
                "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1",
                "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5"}


def _arg_type(value: object) -> str | None:
    """The Triton type a launch gives a runtime argument (None: passed as a constexpr)."""
    import torch

    if isinstance(value, torch.Tensor):
        return "*" + _TORCH_TYPES[str(value.dtype).removeprefix("torch.")]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2 ** 31) <= value < 2 ** 31 else "i64"
    if isinstance(value, float):
        return "fp32"
    return None


def _json_value(value: object) -> object:
    import triton.language as tl

    return {"tl_dtype": str(value)} if isinstance(value, tl.dtype) else value


class LaunchRecorder:
    """Under ``TRITON_INTERPRET=1``, records each distinct Triton launch made inside the
    ``with`` block (kernel, argument types, constexpr values, warps, stages) so that
    :func:`specs_from_records` can compile exactly what ran, for each GPU: a kernel that the
    interpreter runs but that the GPU backend rejects for the types a caller passes (an int64
    where an int32 was assumed) shows before any GPU time is spent. The interpreter's own tile
    choices (``interpreting()``) are what get recorded, not the GPU's; the specs above cover
    those."""

    def __init__(self) -> None:
        self.records: dict[str, dict] = {}

    def __enter__(self) -> LaunchRecorder:
        import json

        import triton.runtime.interpreter as interp

        self._interp = interp
        self._run = run = interp.InterpretedFunction.run

        def recorded(fn_self, *args, grid, warmup, **kwargs):  # type: ignore[no-untyped-def]
            params = inspect.signature(fn_self.fn).parameters
            bound = dict(zip(fn_self.arg_names, args, strict=False))
            bound.update({k: v for k, v in kwargs.items() if k in params})
            types, consts = {}, {}
            for name, value in bound.items():
                kind = _arg_type(value)
                if "constexpr" in str(params[name].annotation) or kind is None:
                    consts[name] = _json_value(value)
                else:
                    types[name] = kind
            rec = {"module": fn_self.fn.__module__, "kernel": fn_self.fn.__name__,
                   "types": types, "constexprs": consts,
                   "num_warps": int(kwargs.get("num_warps", 4)),
                   "num_stages": int(kwargs.get("num_stages", 2))}
            self.records.setdefault(json.dumps(rec, sort_keys=True, default=str), rec)
            return run(fn_self, *args, grid=grid, warmup=warmup, **kwargs)

        interp.InterpretedFunction.run = recorded  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        self._interp.InterpretedFunction.run = self._run  # type: ignore[method-assign]

    def dump(self, path: str) -> None:
        import json

        with open(path, "w") as f:
            json.dump(list(self.records.values()), f, indent=1)


def specs_from_records(path: str, pdl: bool = True) -> list[KernelSpec]:
    """:class:`LaunchRecorder`'s file -> specs (in a process without the interpreter, where the
    kernels are JIT functions that compile). ``pdl``: a kernel that takes ``PDL`` gets it on, as
    a launch on sm_90/sm_120 passes it (the interpreter never does)."""
    import importlib
    import json

    import triton.language as tl

    specs = []
    with open(path) as f:
        for rec in json.load(f):
            fn = getattr(importlib.import_module(rec["module"]), rec["kernel"])
            consts = {k: tl.dtype(v["tl_dtype"]) if isinstance(v, dict) else v
                      for k, v in rec["constexprs"].items()}
            if pdl and takes_pdl(fn) and "PDL" not in consts:
                consts["PDL"] = PDL_ALL
            label = ", ".join(f"{k}={v}" for k, v in sorted(consts.items())
                              if not isinstance(v, tl.dtype))
            types = ",".join(f"{k}:{v}" for k, v in sorted(rec["types"].items()))
            specs.append(KernelSpec(f"{rec['kernel']} [{label}] ({types})", fn, rec["types"],
                                    consts, rec["num_warps"], rec["num_stages"]))
    return specs


def check_all(specs: list[KernelSpec] | None = None, arch: int = 90) -> list[CompileResult]:
    """``arch`` 90 (H100/H200) or 120 (RTX PRO 6000 / RTX 50xx): the portable kernels must
    compile for both; registers are read by ptxas for sm_90a only."""
    target = GPUTarget("cuda", arch, 32)
    return [compile_one(s, target) for s in (specs or with_pdl(default_specs()))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, choices=(90, 120))
    parser.add_argument("--records", help="compile the launches a LaunchRecorder wrote here "
                                          "instead of the default specs")
    parser.add_argument("--no-pdl", action="store_true",
                        help="with --records: compile the launches with PDL off, as recorded "
                             "(default: on where the kernel takes it, as sm_90/sm_120 launch it)")
    parser.add_argument("--failures-only", action="store_true", help="table rows of failures")
    args = parser.parse_args(argv)
    results = check_all(specs_from_records(args.records, pdl=not args.no_pdl)
                        if args.records else None, arch=args.arch)
    print("| kernel | compiles | shared KiB | registers | spill bytes | wgmma |")
    print("|---|---|---|---|---|---|")
    for r in results:
        if args.failures_only and r.ok:
            continue
        print(f"| {r.name} | {'yes' if r.ok else 'NO'} | {r.shared_bytes / 1024:.0f} | "
              f"{r.registers if r.registers is not None else '-'} | "
              f"{r.spill_bytes if r.spill_bytes is not None else '-'} | "
              f"{'yes' if r.uses_wgmma else 'no'} |")
    for r in results:
        if not r.ok:
            print(f"\n{r.name}:\n{r.error}")
    print(f"{sum(r.ok for r in results)} of {len(results)} compile for sm_{args.arch}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
