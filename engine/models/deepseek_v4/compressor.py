"""The KV compressor of CSA/HCA layers (and, at index_head_dim, of the lightning indexer).

Every ``rate`` source tokens close a window that emits one compressed entry: a softmax-gated sum
of the window's projected KV (plus, for the overlapping CSA variant, the previous window's Ca
slice), RMS-normed and rotated at the window's first position. Tokens of a not-yet-closed window
wait in the slot's carry-over buffer, so the result does not depend on where chunk boundaries
fall. Writes only into the fixed :class:`CompressorState`; never grows anything.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.deepseek_v4.cache_state import CompressorState
from engine.models.deepseek_v4.norms import RMSNorm
from engine.models.deepseek_v4.rope import V4Rotary, apply_rope


class V4Compressor(nn.Module):
    """Parameter names follow transformers (``kv_proj``, ``gate_proj``, ``position_bias``,
    ``kv_norm``). ``overlap=True`` is CSA's two-series (Ca/Cb) layout of width ``2 * dim``."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.rate, self.overlap = dim, rate, overlap
        self.kv_proj = nn.Linear(hidden, width, bias=False)
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, width, dtype=torch.float32))
        self.kv_norm = RMSNorm(dim, eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """kv, gate projections [N, width] of every token of the step (one matmul each)."""
        return self.kv_proj(x), self.gate_proj(x)

    def compress(
        self, kv: torch.Tensor, gate: torch.Tensor, st: CompressorState, slot: int, n0: int,
        rotary: V4Rotary,
    ) -> int:
        """Absorb one sequence's chunk (its rows of :meth:`project`, ``[C, width]``) whose first
        token is at position ``n0``; returns the number of entries the slot holds afterwards."""
        r, d = self.rate, self.dim
        b0, e0 = n0 % r, n0 // r
        if b0:
            kv = torch.cat([st.buf_kv[slot, :b0], kv])
            gate = torch.cat([st.buf_gate[slot, :b0], gate])
        nw = kv.shape[0] // r
        usable = nw * r
        rem = kv.shape[0] - usable
        if rem:
            st.buf_kv[slot, :rem] = kv[usable:]
            st.buf_gate[slot, :rem] = gate[usable:]
        if nw == 0:
            return e0
        ck = kv[:usable].view(nw, r, -1)
        cg = gate[:usable].view(nw, r, -1) + self.position_bias  # fp32, as transformers
        if self.overlap:
            assert st.ov_kv is not None and st.ov_gate is not None
            nk = ck.new_zeros((nw, 2 * r, d))
            ng = cg.new_full((nw, 2 * r, d), float("-inf"))
            nk[:, r:] = ck[..., d:]
            ng[:, r:] = cg[..., d:]
            nk[1:, :r] = ck[:-1, :, :d]
            ng[1:, :r] = cg[:-1, :, :d]
            if e0 > 0:  # the previous window's Ca slice, saved when it closed
                nk[0, :r] = st.ov_kv[slot]
                ng[0, :r] = st.ov_gate[slot]
            st.ov_kv[slot] = ck[-1, :, :d]
            st.ov_gate[slot] = cg[-1, :, :d]
            ck, cg = nk, ng
        weights = cg.softmax(dim=1, dtype=torch.float32).to(ck.dtype)
        comp = self.kv_norm((ck * weights).sum(dim=1))  # [nw, d]
        pos = (torch.arange(nw, device=kv.device) + e0) * r
        cos, sin = rotary(pos, comp.dtype)
        st.entries[slot, e0 : e0 + nw] = apply_rope(comp, cos, sin)
        return e0 + nw
