"""DeepSeek-V4's KV compressor (and the indexer's) for one decode token of each row, in two
launches: the token joins its slot's open window, and the rows whose window it closes produce
the window's entry (per-channel softmax-gated sum, RMSNorm, RoPE at the window's first
position) plus, for CSA's overlapping form, the closed window's Ca slice for the next one.
Unfused that is ~40 small kernels per compressor and step (~60 a CSA layer, which has two).
``kernels.compress_decode_ref`` is the specification. State is updated in place; the entry
goes to ``out`` and its flat pool row to ``dst`` (the caller writes the pool: its rows may be
FP8); ``ent`` [B, dim] is scratch.
"""

from __future__ import annotations

import torch

from kernels._checks import check_contiguous, check_positive, check_tensor
from kernels._triton_support import require_triton
from kernels.errors import KernelArgumentError

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_IDX = (torch.int64,)


def compress_decode(
    kv: torch.Tensor, gate: torch.Tensor, writer: torch.Tensor, slots: torch.Tensor,
    positions: torch.Tensor, tables: torch.Tensor, buf_kv: torch.Tensor, buf_gate: torch.Tensor,
    position_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float, inv_freq: torch.Tensor,
    rope_scale: float, block_size: int, *, ent: torch.Tensor, out: torch.Tensor,
    dst: torch.Tensor, ov_kv: torch.Tensor | None = None, ov_gate: torch.Tensor | None = None,
    pool: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``compress_decode_ref`` (same arguments; ``ent``, ``out`` [B, dim] and ``dst`` [B]
    int64 are written). ``pool`` [rows, dim] in out's dtype (the flat entry rows): each closing
    row's entry is also stored at its row ``dst`` there (rows closing nothing store nothing,
    not even to the null row), so the caller need not copy it. Returns (out, dst)."""
    name = "compress_decode"
    dev = kv.device
    check_tensor(name, "buf_kv", buf_kv, shape=(None, None, None), dtypes=_DTYPES, device=dev)
    _, r, width = buf_kv.shape
    check_positive(name, "rate", r)
    overlap = ov_kv is not None
    if overlap and width % 2:
        raise KernelArgumentError(name, "buf_kv", f"overlapping windows need an even width, got {width}")
    d = width // 2 if overlap else width
    n = kv.shape[0] if kv.dim() == 2 else -1
    check_tensor(name, "kv", kv, shape=(n, width), dtypes=(buf_kv.dtype,), device=dev)
    check_tensor(name, "gate", gate, shape=(n, width), dtypes=(buf_kv.dtype,), device=dev)
    for arg, t in (("writer", writer), ("slots", slots), ("positions", positions)):
        check_tensor(name, arg, t, shape=(n,), dtypes=_IDX, device=dev)
        check_contiguous(name, arg, t)
    check_tensor(name, "tables", tables, shape=(n, None), dtypes=_IDX, device=dev)
    check_tensor(name, "buf_gate", buf_gate, shape=tuple(buf_kv.shape), dtypes=(buf_kv.dtype,),
                 device=dev)
    check_contiguous(name, "buf_kv", buf_kv)
    check_contiguous(name, "buf_gate", buf_gate)
    check_tensor(name, "position_bias", position_bias, shape=(r, width), dtypes=(torch.float32,),
                 device=dev)
    check_tensor(name, "norm_weight", norm_weight, shape=(d,), dtypes=(torch.float32,), device=dev)
    check_tensor(name, "inv_freq", inv_freq, shape=(None,), dtypes=(torch.float32,), device=dev)
    if 2 * inv_freq.shape[0] > d:
        raise KernelArgumentError(name, "inv_freq", f"rotates {2 * inv_freq.shape[0]} of {d} channels")
    if block_size % r:
        raise KernelArgumentError(name, "block_size", f"must be a multiple of the rate {r}, got {block_size}")
    if overlap:
        assert ov_kv is not None
        if ov_gate is None:
            raise KernelArgumentError(name, "ov_gate", "is required with ov_kv")
        check_tensor(name, "ov_kv", ov_kv, shape=(None, r, d), dtypes=(buf_kv.dtype,), device=dev)
        check_tensor(name, "ov_gate", ov_gate, shape=tuple(ov_kv.shape), dtypes=(torch.float32,),
                     device=dev)
        check_contiguous(name, "ov_kv", ov_kv)
        check_contiguous(name, "ov_gate", ov_gate)
    for arg, t in (("ent", ent), ("out", out)):
        check_tensor(name, arg, t, shape=(n, d), dtypes=(buf_kv.dtype,), device=dev)
    check_tensor(name, "dst", dst, shape=(n,), dtypes=_IDX, device=dev)
    check_contiguous(name, "dst", dst)
    if pool is not None:
        check_tensor(name, "pool", pool, shape=(None, d), dtypes=(out.dtype,), device=dev)
        if pool.stride(1) != 1:
            raise KernelArgumentError(name, "pool", f"rows must be contiguous, got strides {pool.stride()}")
    require_triton(name, dev)
    from kernels._compress_decode_triton import launch_compress_decode

    if n:
        launch_compress_decode(kv, gate, writer, slots, positions, tables, buf_kv, buf_gate,
                               position_bias, norm_weight, eps, inv_freq, rope_scale, block_size,
                               ov_kv, ov_gate, ent, out, dst, pool)
    return out, dst
