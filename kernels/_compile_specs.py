"""The kernel configurations ``python -m kernels.compile_check`` compiles by default.

The tables of what the wrappers launch: attention, norms, mHC and the DeepSeek-V4 decode step's
fused kernels here; the quantized GEMMs (FP8 linear, MXFP4 MoE) in ``_compile_specs_quant``.
Data only: nothing here compiles or launches a kernel.
"""

from __future__ import annotations

from kernels import _compress_decode_triton as comp
from kernels import _fused_triton as fused
from kernels import _hc_decode_triton as hcd
from kernels import _hc_streams_triton as hcs
from kernels import _indexer_decode_triton as idxd
from kernels import _indexer_triton as idx
from kernels import _moe_decode_triton as moed
from kernels import _paged_attention_triton as paged
from kernels import _rope_norm_triton as rn
from kernels import _sinkhorn_triton as sk
from kernels import _sparse_attention_triton as sparse
from kernels._compile_specs_quant import quantized_specs
from kernels._kernel_spec import KernelSpec, ptr
from kernels._launch_configs import launch_config


def default_specs() -> list[KernelSpec]:
    """The configurations the wrappers launch by default (bf16 unless stated)."""
    scores_types = {"q_ptr": ptr("bf16"), "k_ptr": ptr("bf16"), "w_ptr": ptr("fp32"),
                    "kv_end_ptr": ptr("i32"), "scores_ptr": ptr("fp32"),
                    "q_scale_ptr": ptr("fp32"), "k_scale_ptr": ptr("fp32")}
    fp8_types = scores_types | {"q_ptr": ptr("fp8e4nv"), "k_ptr": ptr("fp8e4nv")}
    tile = {"UPCAST": False, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_D": 128}
    sparse_types = {n: ptr("bf16") for n in ("q_ptr", "out_ptr", "wkv_ptr", "ckv_ptr")}
    sparse_types |= {n: ptr("i32") for n in ("wstart_ptr", "wend_ptr", "bt_ptr", "rowseq_ptr",
                                               "idx_ptr", "cstart_ptr", "cend_ptr")}
    sparse_types |= {"sink_ptr": ptr("fp32"), "qk_scale": "fp32",
                     "part_acc_ptr": ptr("fp32"), "part_ml_ptr": ptr("fp32")}
    sparse_flags = {"PAGE_SIZE": 1, "PAGED": False, "HAS_IDX": True, "HAS_RANGE": True,
                    "HAS_SINK": True, "UPCAST": False, "SPLIT": False, "BLOCK_D": 512}
    kv_types = {n: ptr("bf16") for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
    prefill_types = kv_types | {n: ptr("i32") for n in ("bt_ptr", "qsl_ptr", "ctx_ptr")}
    prefill_types["qk_scale"] = "fp32"
    mixes = {"s_ptr": ptr("bf16"), "fn_ptr": ptr("fp32"), "out_ptr": ptr("fp32"), "eps": "fp32"}
    fp8_kv = {"k_ptr": ptr("fp8e4nv"), "v_ptr": ptr("fp8e4nv")}  # kv_dtype=fp8
    decode_types = kv_types | {"part_acc_ptr": ptr("fp32"), "part_ml_ptr": ptr("fp32"),
                               "bt_ptr": ptr("i32"), "ctx_ptr": ptr("i32"), "qk_scale": "fp32"}
    return [
        KernelSpec("indexer scores bf16", idx._indexer_scores_kernel, scores_types,
                   {"HAS_Q_SCALE": False, "HAS_K_SCALE": False, **tile}),
        KernelSpec("indexer scores fp8", idx._indexer_scores_kernel, fp8_types,
                   {"HAS_Q_SCALE": True, "HAS_K_SCALE": True, **tile}),
        KernelSpec("indexer merge top-512", idx._topk_merge_kernel,
                   {"scores_ptr": ptr("fp32"), "kv_end_ptr": ptr("i32"),
                    "best_ptr": ptr("i64"), "cand_ptr": ptr("i64")},
                   {"KP": 512, "LOG_KP": 9}),
        KernelSpec("indexer merge top-512 (decode: int64 kv_end, 4 parts, 8 warps)",
                   idx._topk_merge_kernel,
                   {"scores_ptr": ptr("fp32"), "kv_end_ptr": ptr("i64"),
                    "best_ptr": ptr("i64"), "cand_ptr": ptr("i64")},
                   {"KP": 512, "LOG_KP": 9, "PARTS": 4}, num_warps=8),
        KernelSpec("indexer combine 4 parts' top-512", idx._topk_combine_kernel,
                   {"best_ptr": ptr("i64"), "out_ptr": ptr("i64")},
                   {"KP": 512, "LOG_KP": 9, "PARTS": 4}, num_warps=8),
        KernelSpec("indexer merge top-2048", idx._topk_merge_kernel,
                   {"scores_ptr": ptr("fp32"), "kv_end_ptr": ptr("i32"),
                    "best_ptr": ptr("i64"), "cand_ptr": ptr("i64")},
                   {"KP": 2048, "LOG_KP": 11}),
        KernelSpec("indexer init", idx._topk_init_kernel, {"best_ptr": ptr("i64")}, {"KP": 512}),
        KernelSpec("indexer finalize", idx._topk_finalize_kernel,
                   {"best_ptr": ptr("i64"), "out_scores_ptr": ptr("fp32"),
                    "out_idx_ptr": ptr("i32")}, {"KP": 512}),
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
                   {"part_acc_ptr": ptr("fp32"), "part_ml_ptr": ptr("fp32"),
                    "out_ptr": ptr("bf16"), "sink_ptr": ptr("fp32")},
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
                   {"part_acc_ptr": ptr("fp32"), "part_ml_ptr": ptr("fp32"),
                    "out_ptr": ptr("bf16")}, {"BLOCK_S": 32, "BLOCK_D": 128}),
        KernelSpec("fused add + rms norm (4096)", fused._add_rms_norm_kernel,
                   {"x_ptr": ptr("bf16"), "res_ptr": ptr("bf16"), "w_ptr": ptr("bf16"),
                    "out_ptr": ptr("bf16"), "eps": "fp32"},
                   {"HAS_RES": True, "BLOCK": 4096}, num_warps=16),
        KernelSpec("fused rope + kv write (d 128)", fused._rope_and_cache_kernel,
                   {p: ptr("bf16") for p in ("q_ptr", "k_ptr", "v_ptr", "cos_ptr", "sin_ptr",
                                               "kc_ptr", "vc_ptr", "qo_ptr")}
                   | {"pos_ptr": ptr("i64"), "slot_ptr": ptr("i64")},
                   {"NUM_Q_HEADS": 32, "HALF": 64, "BLOCK_HALF": 64, "KV_FP8": False},
                   num_warps=1),
        KernelSpec("fused rope + fp8 kv write (d 128)", fused._rope_and_cache_kernel,
                   {p: ptr("bf16") for p in ("q_ptr", "k_ptr", "v_ptr", "cos_ptr", "sin_ptr",
                                               "qo_ptr")}
                   | {"kc_ptr": ptr("fp8e4nv"), "vc_ptr": ptr("fp8e4nv"),
                      "pos_ptr": ptr("i64"), "slot_ptr": ptr("i64")},
                   {"NUM_Q_HEADS": 32, "HALF": 64, "BLOCK_HALF": 64, "KV_FP8": True},
                   num_warps=1),
        KernelSpec("mHC sinkhorn (m 4)", sk._sinkhorn_kernel,
                   {"x_ptr": ptr("fp32"), "out_ptr": ptr("fp32"), "eps": "fp32"},
                   {"BLOCK": 4}, num_warps=1),
        KernelSpec("mHC mixes (prefill, 24 rows)", hcs._hc_mixes_kernel, mixes,
                   {"BLOCK_N": hcs.HC_MIX_BLOCK_N, "BLOCK_R": 32, "BLOCK_K": hcs.HC_MIX_BLOCK_K}),
        KernelSpec("mHC mixes (prefill, 24 rows, bf16 streams: 3-part bf16 dots)",
                   hcs._hc_mixes_kernel, mixes | {"s_ptr": ptr("bf16")},
                   {"BLOCK_N": hcs.HC_MIX_BLOCK_N, "BLOCK_R": 32, "BLOCK_K": hcs.HC_MIX_BLOCK_K,
                    "SPLIT3": True}, num_stages=3),
        KernelSpec("mHC mixes (prefill from 4096 tokens, 24 rows, bf16 streams: 3-part bf16 dots)",
                   hcs._hc_mixes_kernel, mixes | {"s_ptr": ptr("bf16")},
                   {"BLOCK_N": hcs.HC_MIX_BLOCK_N_WIDE, "BLOCK_R": 32,
                    "BLOCK_K": hcs.HC_MIX_BLOCK_K, "SPLIT3": True}, num_stages=3),
        KernelSpec("mHC merge (prefill, bf16 streams)", hcs._hc_merge_kernel,
                   {"post_ptr": ptr("fp32"), "comb_ptr": ptr("fp32"), "bo_ptr": ptr("bf16"),
                    "s_ptr": ptr("bf16"), "out_ptr": ptr("bf16")},
                   {"BLOCK_M": 4, "BLOCK_D": hcs.HC_BLOCK_D, "F32": False}),
        KernelSpec("mHC collapse (prefill, bf16 streams)", hcs._hc_collapse_kernel,
                   {"pre_ptr": ptr("fp32"), "s_ptr": ptr("bf16"), "out_ptr": ptr("bf16")},
                   {"BLOCK_M": 4, "BLOCK_D": hcs.HC_BLOCK_D}),
        KernelSpec("mHC mixes (prefill, head)", hcs._hc_mixes_kernel, mixes,
                   {"BLOCK_N": hcs.HC_MIX_BLOCK_N, "BLOCK_R": 16, "BLOCK_K": hcs.HC_MIX_BLOCK_K}),
        KernelSpec("fused silu * up", fused._silu_and_mul_kernel,
                   {"g_ptr": ptr("bf16"), "u_ptr": ptr("bf16"), "out_ptr": ptr("bf16")},
                   {"BLOCK": 1024}),
        *quantized_specs(),
        *decode_specs(),
    ]


def decode_specs() -> list[KernelSpec]:
    """The DeepSeek-V4 decode step's fused kernels (engine/models/deepseek_v4/step/fused_ops.py)
    at V4-Flash's widths, every compile-time branch the engine takes."""
    hc = {"s_ptr": ptr("bf16"), "fn_ptr": ptr("fp32"), "part_ptr": ptr("fp32"),
          "post_ptr": ptr("fp32"), "comb_ptr": ptr("fp32"), "bo_ptr": ptr("bf16"),
          "out_ptr": ptr("bf16")}
    fin = {"part_ptr": ptr("fp32"), "s_ptr": ptr("bf16"), "base_ptr": ptr("fp32"),
           "scale_ptr": ptr("fp32"), "post_ptr": ptr("fp32"), "comb_ptr": ptr("fp32"),
           "x_ptr": ptr("bf16"), "hc_eps": "fp32", "norm_eps": "fp32"}
    rope = {"x_ptr": ptr("bf16"), "cos_ptr": ptr("bf16"), "sin_ptr": ptr("bf16"),
            "w_ptr": ptr("fp32"), "src_ptr": ptr("i64"), "dst_ptr": ptr("i64"),
            "out_ptr": ptr("bf16"), "eps": "fp32"}
    idx64 = {p: ptr("i64") for p in ("wr_ptr", "slot_ptr", "pos_ptr", "tab_ptr", "dst_ptr")}
    cw = launch_config("compress_window", 1, 128)  # the batch-1 decode settings (HCA)
    cs = launch_config("compress_window", 1, 8)  # (CSA: a window of two series of 4)
    rc = launch_config("moe_router", 1)
    window = idx64 | {"kv_ptr": ptr("bf16"), "g_ptr": ptr("bf16"), "bkv_ptr": ptr("bf16"),
                      "bg_ptr": ptr("bf16"), "pb_ptr": ptr("fp32"), "okv_ptr": ptr("bf16"),
                      "og_ptr": ptr("fp32"), "ent_ptr": ptr("bf16")}
    entry = idx64 | {"ent_ptr": ptr("bf16"), "w_ptr": ptr("fp32"), "freq_ptr": ptr("fp32"),
                     "out_ptr": ptr("bf16"), "pool_ptr": ptr("bf16"), "eps": "fp32",
                     "rope_scale": "fp32"}
    route = {"lg_ptr": ptr("bf16"), "bias_ptr": ptr("fp32"), "hash_ptr": ptr("i64"),
             "tok_ptr": ptr("i64"), "w_ptr": ptr("fp32"), "idx_ptr": ptr("i64"),
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
                   {"part_ptr": ptr("fp32"), "w_ptr": ptr("fp32"), "x_ptr": ptr("bf16"),
                    "norm_eps": "fp32"}, {"BLOCK_S": 64, "BLOCK_D": hcd.HC_MIX_BLOCK_D}),
        KernelSpec("hc_decode norm (1 warp)", hcd._hc_norm_kernel,
                   {"part_ptr": ptr("fp32"), "w_ptr": ptr("fp32"), "x_ptr": ptr("bf16"),
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
                   route | {"x_ptr": ptr("bf16"), "gw_ptr": ptr("bf16"), "sem_ptr": ptr("i32")},
                   {"SCORING": 0, "HASH": False, "BLOCK_G": rc["BLOCK_G"],
                    "BLOCK_H": rc["BLOCK_H"], "BLOCK_E": 256, "BLOCK_K": 8},
                   num_warps=rc["num_warps"]),
        KernelSpec("indexer decode scores (64 x 128)", idxd._indexer_decode_kernel,
                   {"q_ptr": ptr("bf16"), "w_ptr": ptr("fp32"), "k_ptr": ptr("bf16"),
                    "tab_ptr": ptr("i64"), "end_ptr": ptr("i64"), "out_ptr": ptr("fp32")},
                   {"F32": False, "BLOCK_H": 64, "BLOCK_D": 128,
                    "BLOCK_T": idxd.INDEXER_DECODE_BLOCK_T}, num_warps=8),
        KernelSpec("indexer decode top-512 -> pool rows", idxd._topk_rows_finalize_kernel,
                   {"best_ptr": ptr("i64"), "tab_ptr": ptr("i64"), "out_ptr": ptr("i32")},
                   {"KP": 512}),
        KernelSpec("clamped swiglu", moed._clamped_swiglu_kernel,
                   {"g_ptr": ptr("bf16"), "u_ptr": ptr("bf16"), "out_ptr": ptr("bf16"),
                    "limit": "fp32"}, {"BLOCK": 1024}),
    ]
