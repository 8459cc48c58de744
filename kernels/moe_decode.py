"""DeepSeek-V4's MoE glue as single kernels for decode: the routing (scores, top-k, normalised
and scaled weights; ~10 PyTorch kernels a layer unfused), with or without the router's linear
in the same launch, and the shared expert's clamped SwiGLU (~5). ``kernels.moe_decode_ref`` is the specification; both write into caller buffers.
Top-k ties go to the lowest expert index (torch.topk leaves them unspecified)."""

from __future__ import annotations

import torch

from kernels._checks import check_positive, check_tensor
from kernels._triton_support import require_triton
from kernels.errors import KernelArgumentError
from kernels.moe_decode_ref import SCORINGS

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# rows up to which :func:`moe_router` beats the linear then :func:`moe_route` (H100, 4096 wide,
# 128 experts: 5.85 / 6.39 us against 8.01 / 8.06 at 1 / 8 rows, 8.82 against 8.45 at 32;
# lab/results/notebook.md "Fifteenth session")
FUSED_ROUTER_MAX_ROWS = 16


def _check_route(name: str, n: int, e: int, top_k: int, scoring: str, weights: torch.Tensor,
                 experts: torch.Tensor, bias: torch.Tensor | None,
                 hash_table: torch.Tensor | None, token_ids: torch.Tensor | None,
                 dev: torch.device) -> None:
    check_positive(name, "top_k", top_k)
    if top_k > e:
        raise KernelArgumentError(name, "top_k", f"must be <= the {e} experts, got {top_k}")
    if scoring not in SCORINGS:
        raise KernelArgumentError(name, "scoring", f"must be one of {SCORINGS}, got {scoring!r}")
    check_tensor(name, "weights", weights, shape=(n, top_k), dtypes=(torch.float32,), device=dev)
    check_tensor(name, "experts", experts, shape=(n, top_k), dtypes=(torch.int64,), device=dev)
    for arg, t in (("weights", weights), ("experts", experts)):
        if not t.is_contiguous():
            raise KernelArgumentError(name, arg, f"must be contiguous, got strides {t.stride()}")
    if hash_table is None:
        if bias is None:
            raise KernelArgumentError(name, "bias", "is required unless hash_table is given")
        check_tensor(name, "bias", bias, shape=(e,), dtypes=(torch.float32,), device=dev)
    else:
        check_tensor(name, "hash_table", hash_table, shape=(None, top_k), dtypes=(torch.int64,),
                     device=dev)
        if token_ids is None:
            raise KernelArgumentError(name, "token_ids", "is required with hash_table")
        check_tensor(name, "token_ids", token_ids, shape=(n,), dtypes=(torch.int64,), device=dev)


def moe_route(logits: torch.Tensor, top_k: int, scoring: str, scaling: float, *,
              weights: torch.Tensor, experts: torch.Tensor, bias: torch.Tensor | None = None,
              hash_table: torch.Tensor | None = None, token_ids: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``moe_route_ref``. logits [N, E]; weights [N, k] fp32 and experts [N, k] int64
    (contiguous) are written. Score-routed with ``bias`` fp32 [E]; hash-routed with
    ``hash_table`` int64 [vocab, k] and ``token_ids`` int64 [N]."""
    name = "moe_route"
    dev = logits.device
    check_tensor(name, "logits", logits, shape=(None, None), dtypes=_DTYPES, device=dev)
    n, e = logits.shape
    _check_route(name, n, e, top_k, scoring, weights, experts, bias, hash_table, token_ids, dev)
    require_triton(name, dev)
    from kernels._moe_decode_triton import launch_moe_route

    if n:
        launch_moe_route(logits, top_k, scoring, scaling, bias, hash_table, token_ids, weights,
                         experts)
    return weights, experts


def moe_router(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, scoring: str,
               scaling: float, *, weights: torch.Tensor, experts: torch.Tensor,
               logits: torch.Tensor, semaphores: torch.Tensor, bias: torch.Tensor | None = None,
               hash_table: torch.Tensor | None = None, token_ids: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`moe_route` of the router's logits ``x @ gate_weight.T`` ([N, hidden] x [E,
    hidden], one dtype), both in one launch: the logits (fp32 sums rounded to that dtype, as
    the linear rounds; the order of the sums differs) are written to ``logits`` [N, E], then
    each row is routed by the last of its programs. ``semaphores``: int32 counters, zero, at
    least N of them, shared with any launch on the same stream (left zero again, as
    ``kernels.fp8_linear.gemv_semaphores``)."""
    name = "moe_router"
    dev = x.device
    check_tensor(name, "x", x, shape=(None, None), dtypes=_DTYPES, device=dev)
    n, hidden = x.shape
    check_tensor(name, "gate_weight", gate_weight, shape=(None, hidden), dtypes=(x.dtype,),
                 device=dev)
    e = gate_weight.shape[0]
    check_tensor(name, "logits", logits, shape=(n, e), dtypes=(x.dtype,), device=dev)
    for arg, t in (("x", x), ("gate_weight", gate_weight), ("logits", logits)):
        if t.stride(1) != 1:
            raise KernelArgumentError(name, arg, f"rows must be contiguous, got strides {t.stride()}")
    check_tensor(name, "semaphores", semaphores, shape=(None,), dtypes=(torch.int32,), device=dev)
    if semaphores.numel() < n or not semaphores.is_contiguous():
        raise KernelArgumentError(name, "semaphores", f"needs >= {n} contiguous counters, got "
                                  f"{semaphores.numel()} with strides {semaphores.stride()}")
    _check_route(name, n, e, top_k, scoring, weights, experts, bias, hash_table, token_ids, dev)
    require_triton(name, dev)
    from kernels._moe_decode_triton import launch_moe_router

    if n:
        launch_moe_router(x, gate_weight, top_k, scoring, scaling, bias, hash_table, token_ids,
                          weights, experts, logits, semaphores)
    return weights, experts


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, out: torch.Tensor
                   ) -> torch.Tensor:
    """See ``clamped_swiglu_ref``: gate, up, out [N, I] of one dtype -> out."""
    name = "clamped_swiglu"
    dev = gate.device
    check_tensor(name, "gate", gate, shape=(None, None), dtypes=_DTYPES, device=dev)
    for arg, t in (("up", up), ("out", out)):
        check_tensor(name, arg, t, shape=tuple(gate.shape), dtypes=(gate.dtype,), device=dev)
    require_triton(name, dev)
    from kernels._moe_decode_triton import launch_clamped_swiglu

    if gate.numel():
        launch_clamped_swiglu(gate, up, limit, out)
    return out
