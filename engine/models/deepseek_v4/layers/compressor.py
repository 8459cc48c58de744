"""The KV compressor of CSA/HCA layers (and, at index_head_dim, of the lightning indexer).

Every ``rate`` source tokens close a window that emits one compressed entry: a softmax-gated sum
of the window's projected KV (plus, for the overlapping CSA variant, the previous window's Ca
slice), RMS-normed and rotated at the window's first position. Tokens of a not-yet-closed window
wait in the slot's carry-over buffer (engine/models/deepseek_v4/memory/kv_pool.py), so the result does not depend on where chunk boundaries
fall. Writes only into the fixed pool's blocks and slot buffers; never grows anything.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.deepseek_v4.layers.norms import RMSNorm
from engine.models.deepseek_v4.layers.rope import V4Rotary, apply_rope
from engine.models.deepseek_v4.memory.kv_pool import CompressorPool


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
        self, kv: torch.Tensor, gate: torch.Tensor, cp: CompressorPool, slot: int, n0: int,
        rotary: V4Rotary, table: torch.Tensor,
    ) -> int:
        """Absorb one sequence's chunk (its rows of :meth:`project`, ``[C, width]``) whose first
        token is at position ``n0``; ``table``: the sequence's block ids [blocks] int64. Entries
        and the CSA overlap go to the sequence's blocks, the open window to the slot's buffer.
        Returns the number of entries the sequence has afterwards."""
        r, d = self.rate, self.dim
        b0, e0 = n0 % r, n0 // r
        if b0:
            kv = torch.cat([cp.buf_kv[slot, :b0], kv])
            gate = torch.cat([cp.buf_gate[slot, :b0], gate])
        nw = kv.shape[0] // r
        usable = nw * r
        rem = kv.shape[0] - usable
        if rem:
            cp.buf_kv[slot, :rem] = kv[usable:]
            cp.buf_gate[slot, :rem] = gate[usable:]
        if nw == 0:
            return e0
        ck = kv[:usable].view(nw, r, -1)
        cg = gate[:usable].view(nw, r, -1) + self.position_bias  # fp32, as transformers
        if self.overlap:
            assert cp.ov_kv is not None and cp.ov_gate is not None
            nk = ck.new_zeros((nw, 2 * r, d))
            ng = cg.new_full((nw, 2 * r, d), float("-inf"))
            nk[:, r:] = ck[..., d:]
            ng[:, r:] = cg[..., d:]
            nk[1:, :r] = ck[:-1, :, :d]
            ng[1:, :r] = cg[:-1, :, :d]
            if e0 > 0:  # the previous window's Ca slice, kept in the block that holds it
                b = (e0 - 1) * r // cp.block_size
                nk[0, :r] = cp.ov_kv.index_select(0, table[b : b + 1])[0]
                ng[0, :r] = cp.ov_gate.index_select(0, table[b : b + 1])[0]
            # every block keeps the Ca slice of its last closed window (what a sequence resuming
            # at the block's end needs); the chunk's last window also goes to its block. The
            # other windows' slices go to the null block (never read) rather than through a
            # boolean selection, whose size the host would have to wait for.
            w = torch.arange(e0, e0 + nw, device=table.device)
            last = ((w + 1) * r % cp.block_size == 0) | (w == e0 + nw - 1)
            blocks = torch.where(last, cp.block_of_window(table, w), 0)
            cp.ov_kv.index_copy_(0, blocks, ck[:, :, :d].to(cp.ov_kv.dtype))
            cp.ov_gate.index_copy_(0, blocks, cg[:, :, :d].contiguous())
            ck, cg = nk, ng
        weights = cg.softmax(dim=1, dtype=torch.float32).to(ck.dtype)
        comp = self.kv_norm((ck * weights).sum(dim=1))  # [nw, d]
        pos = (torch.arange(nw, device=kv.device) + e0) * r
        cos, sin = rotary(pos, comp.dtype)
        cp.entries.write(cp.entry_rows(table, e0, nw), apply_rope(comp, cos, sin))
        return e0 + nw
