"""Fused elementwise steps of the dense decoder layer, for decode steps whose cost is kernel
launches rather than bytes: residual add + RMSNorm, rotary embedding of q and k together with the
paged KV write, and SiLU-and-multiply. Triton kernels (``kernels._fused_triton``) behind checked
wrappers that write into caller buffers; ``kernels.fused_ref`` is the specification.

Rounding follows the unfused PyTorch code (each elementwise op returns the storage dtype), so on
fp32 the results equal the reference to the last bits and on bf16 they differ only where a
reduction's order does (the RMSNorm sum). No scratch: these kernels take no workspace.
"""

from __future__ import annotations

import torch

from kernels._checks import check_tensor
from kernels._triton_support import require_triton
from kernels.errors import KernelArgumentError
from kernels.kv_quant import KV_FP8_DTYPE

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_INDEX = (torch.int32, torch.int64)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, out: torch.Tensor) -> torch.Tensor:
    """out = RMSNorm(x + residual) * weight; ``residual`` (when given) is updated in place to
    x + residual, the next layer's residual. x, residual, out: [N, C]; weight: [C]. -> out."""
    name = "add_rms_norm"
    dev = x.device
    check_tensor(name, "x", x, shape=(None, None), dtypes=_FLOATS, device=dev)
    n, c = x.shape
    if residual is not None:
        check_tensor(name, "residual", residual, shape=(n, c), dtypes=(x.dtype,), device=dev)
    check_tensor(name, "weight", weight, shape=(c,), dtypes=_FLOATS, device=dev)
    check_tensor(name, "out", out, shape=(n, c), dtypes=_FLOATS, device=dev)
    if c > 65536:
        raise KernelArgumentError(name, "x", f"rows of {c} columns exceed one program (65536)")
    require_triton(name, dev)
    from kernels._fused_triton import launch_add_rms_norm

    if n:
        launch_add_rms_norm(x, residual, weight, eps, out)
    return out


def rope_and_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, q_out: torch.Tensor) -> torch.Tensor:
    """Rotate q into ``q_out`` and write rotated k and plain v into the paged caches at
    ``slot_mapping``. q/q_out: [N, Hq, D]; k, v: [N, Hkv, D] (any row/head strides, D
    contiguous); positions, slot_mapping: [N]; cos/sin: [P, D] tables (rotary over all of D);
    k_cache/v_cache: [num_blocks, block_size, Hkv, D] contiguous, q's dtype or FP8 e4m3fn
    (written as ``kernels.kv_quant.quantize_kv``: clamped and rounded). -> q_out."""
    name = "rope_and_cache"
    dev = q.device
    check_tensor(name, "q", q, shape=(None, None, None), dtypes=_FLOATS, device=dev)
    n, hq, d = q.shape
    check_tensor(name, "k", k, shape=(n, None, d), dtypes=(q.dtype,), device=dev)
    hkv = k.shape[1]
    check_tensor(name, "v", v, shape=(n, hkv, d), dtypes=(q.dtype,), device=dev)
    check_tensor(name, "q_out", q_out, shape=(n, hq, d), dtypes=(q.dtype,), device=dev)
    check_tensor(name, "positions", positions, shape=(n,), dtypes=_INDEX, device=dev)
    check_tensor(name, "slot_mapping", slot_mapping, shape=(n,), dtypes=_INDEX, device=dev)
    check_tensor(name, "cos", cos, shape=(None, d), dtypes=(q.dtype,), device=dev)
    check_tensor(name, "sin", sin, shape=tuple(cos.shape), dtypes=(q.dtype,), device=dev)
    check_tensor(name, "k_cache", k_cache, shape=(None, None, hkv, d),
                 dtypes=(q.dtype, KV_FP8_DTYPE), device=dev)
    check_tensor(name, "v_cache", v_cache, shape=tuple(k_cache.shape), dtypes=(k_cache.dtype,),
                 device=dev)
    if d % 2:
        raise KernelArgumentError(name, "q", f"head_dim must be even for rotary, got {d}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise KernelArgumentError(name, "k_cache", "the caches must be contiguous")
    require_triton(name, dev)
    from kernels._fused_triton import launch_rope_and_cache

    if n:
        launch_rope_and_cache(q, k, v, positions, cos, sin, slot_mapping, k_cache, v_cache, q_out)
    return q_out


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = silu(gate) * up; all [N, I]. -> out."""
    name = "silu_and_mul"
    dev = gate.device
    check_tensor(name, "gate", gate, shape=(None, None), dtypes=_FLOATS, device=dev)
    check_tensor(name, "up", up, shape=tuple(gate.shape), dtypes=(gate.dtype,), device=dev)
    check_tensor(name, "out", out, shape=tuple(gate.shape), dtypes=(gate.dtype,), device=dev)
    require_triton(name, dev)
    from kernels._fused_triton import launch_silu_and_mul

    if gate.shape[0]:
        launch_silu_and_mul(gate, up, out)
    return out
