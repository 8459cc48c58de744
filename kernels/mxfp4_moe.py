"""The routed experts of an MoE layer with MXFP4 weights, fused: tokens sorted by expert on the
device, one launch for every expert's gate-up GEMM with the clamped SwiGLU in its epilogue, one
launch for every expert's down GEMM with the routing weight in its epilogue, one combine.

No host sync, no ``.tolist()`` and no torch op on the device: the sort by expert is a counting
sort in two small Triton kernels writing into caller buffers, and the GEMM kernels find their
expert from the device-side counts, so a step is the same five launches whatever the routing
(and can be captured in a CUDA graph) and allocates nothing. Scratch is sized by tokens x top-k
(``moe_experts_workspace_bytes``) and carved from the caller's workspace.
``kernels.mxfp4_moe_ref`` is the specification (layout described there).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels._checks import check_tensor
from kernels._triton_support import require_triton
from kernels.errors import KernelArgumentError
from kernels.moe_sort_sizes import GEMV_MAX_PAIRS, sort_scratch_numel
from kernels.mxfp4_moe_ref import MXFP4_GROUP, as_bytes

_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_PACKED_DTYPES = (torch.uint8, torch.int8) + tuple(
    d for d in (getattr(torch, "float4_e2m1fn_x2", None),) if d is not None)
_SCALE_DTYPES = (torch.uint8,) + tuple(
    d for d in (getattr(torch, "float8_e8m0fnu", None),) if d is not None)
_ALIGN = 256


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


FP8_MIN_TOKENS = 128  # the FP8 form is meant for prefill-sized steps, from this many tokens


def uses_fp8(num_tokens: int, hidden: int, intermediate: int) -> bool:
    """True when the FP8 x FP8 prefill form suits a step (callers opt in with ``fp8=True``;
    the default is the weight-only form): a prefill-sized step, and hidden and intermediate
    sizes made of whole 128-wide activation groups (every V4 shape; tiny test shapes may not
    be). On the H200 the form was not yet faster (lab/results/notebook.md)."""
    return num_tokens >= FP8_MIN_TOKENS and hidden % 128 == 0 and intermediate % 128 == 0


SPLIT_MAX_PAIRS = 256  # split-K is a decode form: (tokens x top-k) pairs up to this many


def moe_splits(num_pairs: int, hidden: int, intermediate: int) -> tuple[int, int]:
    """(gate-up, down) split-K of the weight-decoding form at ``num_pairs`` token-expert
    pairs: at most that many slices of the hidden (gate-up) and intermediate (down) dims, so
    a decode step's few touched experts spread over more programs with shorter K loops. The
    one place the default is chosen; the workspace helpers below follow it. The per-pair form
    (up to ``GEMV_MAX_PAIRS``) cuts the gate-up GEMV in two: on the H200 (``python -m
    lab.bench.quant_decode_sweep --only moe``, V4-Flash's 4096 x 2048 experts, top-6, 2-warp
    int32-word tiles) 0.061 against 0.074 ms at one token and 0.358 against 0.367 at 8. The
    tiled form gained nothing from a split at 32 tokens."""
    if num_pairs <= GEMV_MAX_PAIRS:
        return (2, 1)
    return (1, 1)



def _parts(num_tokens: int, top_k: int, hidden: int, intermediate: int, num_experts: int,
           dtype: torch.dtype, fp8: bool = False, splits: tuple[int, int] | None = None,
           ) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    m = num_tokens * top_k
    head = [("order", (m,), torch.int64), ("row_end", (num_experts,), torch.int32)]
    if sort_scratch_numel(m, num_experts):  # the tiled sort of a prefill-sized step
        head.append(("sort_counts", (sort_scratch_numel(m, num_experts),), torch.int32))
    if fp8:  # token codes + scales, SwiGLU output codes + scales, one e4m3 byte a value
        return head + [("xq", (num_tokens, hidden), torch.uint8),
                       ("xs", (num_tokens, -(-hidden // 128)), torch.float32),
                       ("hq", (m, intermediate), torch.uint8),
                       ("hs", (m, -(-intermediate // 128)), torch.float32),
                       ("y", (m, hidden), dtype)]
    gu, dn = _splits(m, hidden, intermediate, splits)
    parts = head + [("h", (m, intermediate), dtype)]
    if gu > 1:  # fp32 gate and up partials of each slice, summed by the SwiGLU epilogue
        parts.append(("gu_part", (gu, m, 2 * intermediate), torch.float32))
    if dn > 1:  # fp32 weighted partials of each slice, summed by the combine
        return parts + [("y", (dn, m, hidden), torch.float32)]
    return parts + [("y", (m, hidden), dtype)]


def _splits(num_pairs: int, hidden: int, intermediate: int,
            splits: tuple[int, int] | None) -> tuple[int, int]:
    if num_pairs > SPLIT_MAX_PAIRS:
        return (1, 1)
    gu, dn = splits or moe_splits(num_pairs, hidden, intermediate)
    if gu < 1 or dn < 1:
        raise KernelArgumentError("moe_experts", "splits", f"must be >= 1, got {(gu, dn)}")
    return gu, dn


def moe_experts_workspace_bytes(num_tokens: int, top_k: int, hidden: int, intermediate: int,
                                num_experts: int, dtype: torch.dtype = torch.bfloat16,
                                fp8: bool = False, splits: tuple[int, int] | None = None) -> int:
    """Scratch of :func:`moe_experts` at ``num_tokens`` tokens: the sorted order (pairs x 8 B),
    the expert boundaries (experts x 4 B), from 1,024 pairs the tiled sort's counts ((pairs / 128
    rounded up + 1) x experts x 4 B), the weighted expert outputs (pairs x hidden) in the
    activation dtype, and the SwiGLU output: pairs x intermediate in the activation dtype, or
    in the FP8 form (``fp8``) one byte a value + an fp32 scale per 128,
    plus the tokens' codes, tokens x hidden x (1 + 4/128) B; 256-B aligned each. With split-K
    (``splits``, None: :func:`moe_splits`; decode sizes only) the gate-up partials, split x
    pairs x 2 x intermediate x 4 B, and the weighted outputs as split x pairs x hidden x 4 B."""
    return sum(_aligned(torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size())
               for _, shape, dt in _parts(num_tokens, top_k, hidden, intermediate, num_experts,
                                          dtype, fp8, splits))


def moe_experts_max_workspace_bytes(max_tokens: int, top_k: int, hidden: int, intermediate: int,
                                    num_experts: int, dtype: torch.dtype = torch.bfloat16,
                                    fp8: bool = False) -> int:
    """The most :func:`moe_experts_workspace_bytes` asks at any step of 1..``max_tokens``
    tokens with the default splits (a small decode step may split and need more than a larger
    one that does not): what a planner reserves."""
    small = range(1, min(max_tokens, SPLIT_MAX_PAIRS // max(top_k, 1)) + 1)
    return max(moe_experts_workspace_bytes(t, top_k, hidden, intermediate, num_experts, dtype,
                                           fp8) for t in (*small, max_tokens))


def _carve(workspace: torch.Tensor | None, parts: list[tuple[str, tuple[int, ...], torch.dtype]],
           device: torch.device) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name, shape, dt in parts:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
        if workspace is None:
            out[name] = torch.empty(shape, dtype=dt, device=device)
            continue
        out[name] = workspace[offset:offset + nbytes].view(dt).view(shape)
        offset += _aligned(nbytes)
    return out


def moe_experts(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
    down_scale: torch.Tensor, swiglu_limit: float, out: torch.Tensor, *,
    accumulate: bool = False, workspace: torch.Tensor | None = None, fp8: bool = False,
    fp8_tiles: tuple[int, int, int, int, int] | None = None,
    splits: tuple[int, int] | None = None,
    tiles: tuple[int, ...] | None = None,
    before_combine: Callable[[], None] | None = None,
) -> torch.Tensor:
    """x [T, H] (H a multiple of 32); topk_weights [T, k] fp32; topk_ids [T, k] int64 in
    [0, E); gate_up [E, 2I, H/2] packed e2m1 with gate_up_scale [E, 2I, H/32] e8m0; down
    [E, H, I/2] with down_scale [E, H, I/32]; out [T, H] (``accumulate``: added to what it
    holds, e.g. the shared expert's output). ``workspace``: uint8 of at least
    ``moe_experts_workspace_bytes`` bytes (allocated here when None). ``fp8``: the prefill form
    (tokens and SwiGLU output quantized to e4m3 per 1 x 128, FP8 x FP8 MMA; hidden and
    intermediate multiples of 128); ``kernels.mxfp4_moe_ref.moe_experts_fp8_ref`` is its
    specification.
    ``fp8_tiles``: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of that form, BLOCK_K 32, 64 or
    128 (None: ``_mxfp4_moe_fp8_triton.fp8_moe_tiles``). ``splits``: (gate-up, down) split-K
    of the weight-only form at decode sizes (None: :func:`moe_splits`). ``tiles``: (BLOCK_M,
    BLOCK_N, BLOCK_K, warps, stages[, swap, scaled, words, n-first]) of that form (None:
    ``_mxfp4_moe_tiles.moe_tiles``). ``before_combine``: called on the host right before the
    launch that reads ``out`` (never, with no tokens), e.g. for the stream to wait for the one
    that wrote it."""
    name = "moe_experts"
    dev = x.device
    check_tensor(name, "x", x, shape=(None, None), dtypes=_ACT_DTYPES, device=dev)
    t, hid = x.shape
    check_tensor(name, "topk_ids", topk_ids, shape=(t, None), dtypes=(torch.int64,), device=dev)
    k = topk_ids.shape[1]
    check_tensor(name, "topk_weights", topk_weights, shape=(t, k), dtypes=(torch.float32,), device=dev)
    check_tensor(name, "gate_up", gate_up, shape=(None, None, None), dtypes=_PACKED_DTYPES, device=dev)
    e, two_i, _ = gate_up.shape
    if hid % MXFP4_GROUP or two_i % 2 or (two_i // 2) % MXFP4_GROUP:
        raise KernelArgumentError(name, "gate_up", f"hidden {hid} and intermediate {two_i // 2} "
                                  f"must be multiples of {MXFP4_GROUP} (one e8m0 scale per 32)")
    inter = two_i // 2
    check_tensor(name, "gate_up", gate_up, shape=(e, two_i, hid // 2), dtypes=_PACKED_DTYPES, device=dev)
    check_tensor(name, "gate_up_scale", gate_up_scale, shape=(e, two_i, hid // MXFP4_GROUP),
                 dtypes=_SCALE_DTYPES, device=dev)
    check_tensor(name, "down", down, shape=(e, hid, inter // 2), dtypes=_PACKED_DTYPES, device=dev)
    check_tensor(name, "down_scale", down_scale, shape=(e, hid, inter // MXFP4_GROUP),
                 dtypes=_SCALE_DTYPES, device=dev)
    check_tensor(name, "out", out, shape=(t, hid), dtypes=_ACT_DTYPES, device=dev)
    for arg, ten in (("gate_up", gate_up), ("down", down), ("topk_ids", topk_ids),
                     ("topk_weights", topk_weights)):
        if not ten.is_contiguous():
            raise KernelArgumentError(name, arg, f"must be contiguous, got strides {ten.stride()}")
    splits = (1, 1) if fp8 else _splits(t * k, hid, inter, splits)
    parts = _parts(t, k, hid, inter, e, x.dtype, fp8, splits)
    if workspace is not None:
        need = moe_experts_workspace_bytes(t, k, hid, inter, e, x.dtype, fp8, splits)
        if workspace.dtype != torch.uint8 or workspace.numel() < need or workspace.device != dev:
            raise KernelArgumentError(name, "workspace", f"must be uint8 on {dev} with >= {need} "
                                      f"bytes, got {workspace.dtype} x {workspace.numel()}")
    require_triton(name, dev)
    if t == 0:
        return out
    from kernels._mxfp4_moe_triton import launch_moe

    buf = _carve(workspace, parts, dev)
    w = (as_bytes(gate_up), as_bytes(gate_up_scale), as_bytes(down), as_bytes(down_scale))
    if fp8:
        from kernels._mxfp4_moe_fp8_triton import GROUP
        from kernels.fp8_w8a8 import fp8_act_quant

        if hid % GROUP or inter % GROUP:
            raise KernelArgumentError(name, "gate_up", f"the FP8 form needs hidden {hid} and "
                                      f"intermediate {inter} to be multiples of {GROUP}")
        fp8_act_quant(x.unsqueeze(1), buf["xq"].unsqueeze(1), buf["xs"].unsqueeze(1))
    launch_moe(x, topk_ids.view(-1), buf["order"], buf["row_end"], topk_weights.view(-1), *w,
               swiglu_limit, buf.get("h"), buf["y"], out, k, accumulate,
               fp8_scratch=(buf["xq"], buf["xs"], buf["hq"], buf["hs"]) if fp8 else None,
               tiles=tiles, fp8_tiles=fp8_tiles, sort_counts=buf.get("sort_counts"),
               splits=splits, gu_part=buf.get("gu_part"), before_combine=before_combine)
    return out
