"""Bulkhead kernels: lightning indexer with running top-k, DeepSeek-V4 sparse attention, dense
paged attention, the dense layer's fused elementwise steps (norm, rope + KV write, SiLU), the
block-scaled FP8 linear and the fused MXFP4 routed experts, and DeepSeek-V4's fused decode-step
kernels (mHC between blocks, norm + RoPE rows, the compressor's window, MoE routing). Each is a Triton kernel behind one checked wrapper that writes into caller
buffers, a ``*_workspace_bytes`` size function for the memory planner, and a PyTorch reference
(``*_ref``) that is its specification. Importing this package never imports triton (the CPU
engine uses the references); the Triton modules load on the first wrapper call.
This package must never import anything else of ours.
"""

from kernels._triton_support import pdl_launch, pdl_mode
from kernels.compress_decode import compress_decode
from kernels.compress_decode_ref import compress_decode_ref
from kernels.errors import KernelArgumentError, KernelUnavailableError
from kernels.fp8_linear import fp8_grouped_linear, fp8_linear
from kernels.fp8_linear_ref import dequantize_fp8_block, fp8_grouped_linear_ref, fp8_linear_ref
from kernels.fused import add_rms_norm, rope_and_cache, silu_and_mul
from kernels.fused_ref import add_rms_norm_ref, rope_and_cache_ref, silu_and_mul_ref
from kernels.hc_decode import hc_decode, hc_decode_partial_shape
from kernels.hc_decode_ref import hc_decode_ref
from kernels.indexer_decode import indexer_decode_scores
from kernels.indexer_decode_ref import indexer_decode_scores_ref
from kernels.indexer_topk import (
    DEFAULT_TILES,
    IndexerTiles,
    indexer_topk,
    indexer_topk_workspace_bytes,
)
from kernels.indexer_topk_ref import indexer_scores_ref, indexer_topk_naive, indexer_topk_ref
from kernels.moe_decode import clamped_swiglu, moe_route
from kernels.moe_decode_ref import clamped_swiglu_ref, moe_route_ref
from kernels.mxfp4_moe import moe_experts, moe_experts_workspace_bytes
from kernels.mxfp4_moe_ref import dequantize_mxfp4, moe_experts_ref, quantize_mxfp4
from kernels.paged_attention import (
    DEFAULT_PAGED_TILES,
    PagedTiles,
    default_decode_splits,
    paged_attention,
    paged_decode_attention,
    paged_decode_workspace_bytes,
)
from kernels.paged_attention_ref import paged_attention_ref, paged_decode_attention_ref
from kernels.rope_norm import rope_norm
from kernels.rope_norm_ref import rope_norm_ref
from kernels.sinkhorn import sinkhorn
from kernels.sinkhorn_ref import sinkhorn_ref
from kernels.sparse_attention import (
    SparseTiles,
    default_sparse_tiles,
    sparse_attention,
    sparse_attention_workspace_bytes,
)
from kernels.sparse_attention_ref import sparse_attention_ref

__all__ = [
    "DEFAULT_PAGED_TILES",
    "DEFAULT_TILES",
    "IndexerTiles",
    "KernelArgumentError",
    "KernelUnavailableError",
    "PagedTiles",
    "SparseTiles",
    "add_rms_norm",
    "add_rms_norm_ref",
    "clamped_swiglu",
    "clamped_swiglu_ref",
    "compress_decode",
    "compress_decode_ref",
    "hc_decode",
    "hc_decode_partial_shape",
    "hc_decode_ref",
    "indexer_decode_scores",
    "indexer_decode_scores_ref",
    "moe_route",
    "moe_route_ref",
    "rope_norm",
    "rope_norm_ref",
    "default_sparse_tiles",
    "default_decode_splits",
    "dequantize_fp8_block",
    "dequantize_mxfp4",
    "fp8_grouped_linear",
    "fp8_grouped_linear_ref",
    "fp8_linear",
    "fp8_linear_ref",
    "moe_experts",
    "moe_experts_ref",
    "moe_experts_workspace_bytes",
    "quantize_mxfp4",
    "indexer_scores_ref",
    "indexer_topk",
    "indexer_topk_naive",
    "indexer_topk_ref",
    "indexer_topk_workspace_bytes",
    "paged_attention",
    "paged_attention_ref",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_decode_workspace_bytes",
    "pdl_launch",
    "pdl_mode",
    "rope_and_cache",
    "rope_and_cache_ref",
    "silu_and_mul",
    "sinkhorn",
    "sinkhorn_ref",
    "silu_and_mul_ref",
    "sparse_attention",
    "sparse_attention_ref",
    "sparse_attention_workspace_bytes",
]
