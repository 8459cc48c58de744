"""PyTorch reference (the specification) of ``kernels.compress_decode``: one decode token of
each row joins its slot's open compressor window (DeepSeek-V4's KV compressor, CSA's
overlapping two-series form or the plain one); rows whose window it closes produce the window's
entry: softmax-gated sum over the window (per channel), RMSNorm, RoPE at the window's first
position. The same steps as the engine's batched decode (decode_step.compress_decode), on
plain tensors."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.rope_norm_ref import rope_norm_ref

NULL_ROW = 0  # flat entry row 0 lies in the null block 0, which no sequence reads


def compress_decode_ref(
    kv: torch.Tensor, gate: torch.Tensor, writer: torch.Tensor, slots: torch.Tensor,
    positions: torch.Tensor, tables: torch.Tensor, buf_kv: torch.Tensor, buf_gate: torch.Tensor,
    position_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float, inv_freq: torch.Tensor,
    rope_scale: float, block_size: int, ov_kv: torch.Tensor | None = None,
    ov_gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """kv, gate: [B, width] this step's projections; writer [B]: the row whose values a row
    writes (itself, or row 0 for a CUDA graph's pad rows, which share row 0's slot and
    position); slots, positions [B]; tables [B, blocks] block ids. State updated in place:
    buf_kv/buf_gate [slots, rate, width] (the open windows), and with ``ov_kv`` [blocks, rate,
    dim] / ``ov_gate`` fp32 (CSA) the Ca slice of each block's last closed window.
    Returns (entries [B, dim] in kv's dtype, flat entry rows [B] int64 to write them to;
    ``NULL_ROW`` for rows that close nothing and for pad rows)."""
    r = buf_kv.shape[1]
    overlap = ov_kv is not None
    d = buf_kv.shape[2] // 2 if overlap else buf_kv.shape[2]
    b0, e0 = positions % r, positions // r
    is_writer = writer == torch.arange(kv.shape[0], device=kv.device)
    buf_kv[slots, b0] = kv[writer].to(buf_kv.dtype)
    buf_gate[slots, b0] = gate[writer].to(buf_gate.dtype)
    closing = (b0 == r - 1) & is_writer
    ck = buf_kv[slots]  # [B, r, width]
    cg = buf_gate[slots] + position_bias  # fp32
    if overlap:
        assert ov_gate is not None
        has_prev = (e0 > 0)[:, None, None]
        prev = tables.gather(1, ((e0 - 1).clamp(min=0) * r // block_size)[:, None])[:, 0]
        pk = torch.where(has_prev, ov_kv[prev], 0)  # [B, r, d]: the previous window's Ca slice
        pg = torch.where(has_prev, ov_gate[prev], float("-inf"))
        own = torch.where(closing, tables.gather(1, (e0 * r // block_size)[:, None])[:, 0], 0)
        ov_kv[own] = ck[:, :, :d].to(ov_kv.dtype)  # rows closing nothing write the null block
        ov_gate[own] = cg[:, :, :d]
        ck = torch.cat([pk.to(ck.dtype), ck[..., d:]], dim=1)  # [B, 2r, d]
        cg = torch.cat([pg, cg[..., d:]], dim=1)
    weights = cg.softmax(dim=1, dtype=torch.float32).to(ck.dtype)
    entry = (ck * weights).sum(dim=1)  # [B, d]
    entry = F.rms_norm(entry.float(), (d,), norm_weight, eps).to(entry.dtype)
    freqs = (e0 * r).float()[:, None] * inv_freq[None, :]
    cos = (freqs.cos() * rope_scale).to(entry.dtype)
    sin = (freqs.sin() * rope_scale).to(entry.dtype)
    entry = rope_norm_ref(entry, cos, sin, norm=False)
    per = block_size // r
    row = tables.gather(1, (e0 // per)[:, None])[:, 0] * per + e0 % per
    return entry, torch.where(closing, row, NULL_ROW)
