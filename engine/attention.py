"""Dense paged attention for the engine, computed in KV tiles so scratch is O(chunk x tile).

Two paths behind one function: on CUDA the Triton kernels of ``kernels/`` (when importable); on any
device the PyTorch path below, which takes every buffer from the workspace and is the reference the
engine is tested with on CPU. Both read a cache in the model dtype or in FP8 e4m3fn
(kernels/kv_quant.py, scale 1: reading is an upcast). Never allocates scratch that scales with
context length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.step_batch import StepBatch
from engine.workspace import Workspace, _align

_F32 = torch.float32


@dataclass(frozen=True)
class AttentionShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    tile_tokens: int  # keys per tile; a multiple of block_size

    def __post_init__(self) -> None:
        assert self.tile_tokens % self.block_size == 0, "tile must be whole blocks"

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


def _buffers(shape: AttentionShape, rows: int, batch: int,
             kv_dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Every scratch buffer one call takes, for ``batch`` sequences of ``rows`` queries each."""
    hkv, g, d, t = shape.num_kv_heads, shape.group, shape.head_dim, shape.tile_tokens
    gq = g * rows
    return [
        ((batch * t, hkv, d), kv_dtype),  # k tile as stored
        ((batch * t, hkv, d), kv_dtype),  # v tile as stored
        ((batch, 1, gq, t), torch.bool),  # causal mask of the tile
        ((batch, hkv, gq), _F32),  # row sums of one tile
        ((batch, hkv, gq, d), _F32),  # q, regrouped by KV head
        ((batch, t, hkv, d), _F32),  # k tile
        ((batch, t, hkv, d), _F32),  # v tile
        ((batch, hkv, gq, t), _F32),  # scores / probabilities
        ((batch, hkv, gq), _F32),  # running max
        ((batch, hkv, gq), _F32),  # running denominator
        ((batch, hkv, gq), _F32),  # scratch max / correction
        ((batch, hkv, gq, d), _F32),  # accumulator
        ((batch, hkv, gq, d), _F32),  # p @ v of one tile
        ((batch, t), torch.int64),  # gathered slot indices
    ]


def attention_workspace_bytes(shape: AttentionShape, chunk_tokens: int, max_batch: int,
                              kv_dtype: torch.dtype) -> int:
    """Worst case over the two ways a step calls attention: one sequence with a chunk of
    ``chunk_tokens`` queries, or ``max_batch`` single-query decodes."""

    def total(rows: int, batch: int) -> int:
        return sum(_align(_numel(s) * torch.empty((), dtype=dt).element_size())
                   for s, dt in _buffers(shape, rows, batch, kv_dtype))

    return max(total(chunk_tokens, 1), total(1, max_batch))


def _numel(s: tuple[int, ...]) -> int:
    n = 1
    for x in s:
        n *= x
    return n


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    batch: StepBatch, scale: float, out: torch.Tensor, ws: Workspace,
                    shape: AttentionShape) -> torch.Tensor:
    """q, out: [N, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D].

    Sequence b's queries are its last q_len tokens (causal). With the kernel tensors of the batch
    set (CUDA), one Triton launch covers every sequence and needs no scratch. Otherwise the
    PyTorch path: single-query sequences batched together, each multi-query chunk alone.
    """
    if batch.block_tables_t is not None:
        import kernels

        return kernels.paged_attention(q, k_cache, v_cache, batch.block_tables_t,
                                       batch.query_start_loc_t, batch.context_lens_t, scale, out)
    decode_idx = [i for i in range(batch.num_seqs) if batch.query_len(i) == 1]
    if decode_idx:
        _attend(q, k_cache, v_cache, batch, decode_idx, 1, scale, out, ws, shape)
    for i in range(batch.num_seqs):
        q_len = batch.query_len(i)
        if q_len > 1:
            _attend(q, k_cache, v_cache, batch, [i], q_len, scale, out, ws, shape)
    return out


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: StepBatch,
            seqs: list[int], rows: int, scale: float, out: torch.Tensor, ws: Workspace,
            shape: AttentionShape) -> None:
    hkv, g, d, t, bs = (shape.num_kv_heads, shape.group, shape.head_dim, shape.tile_tokens,
                        shape.block_size)
    b = len(seqs)
    gq = g * rows
    dev = q.device
    with ws.scope():
        bufs = [ws.take(s, dt, caller="attention.paged_attention")
                for s, dt in _buffers(shape, rows, b, k_cache.dtype)]
        k_raw, v_raw, masked, rowsum, qg, kt, vt, scores, m, denom, m_new, acc, pv, slots = bufs
        starts = [batch.query_start_loc[i] for i in seqs]
        ctx = [batch.context_lens[i] for i in seqs]
        # q: [b, rows, Hq, D] -> [b, Hkv, G*rows, D] (row r of group j at index j*rows + r)
        for j, s in enumerate(starts):
            qs = q[s : s + rows].view(rows, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, gq, d)
            qg[j].copy_(qs)
        qg.mul_(scale)
        m.fill_(float("-inf"))
        denom.zero_()
        acc.zero_()
        # query position of each row: context_len - rows + r
        row_pos = torch.arange(rows, device=dev).repeat(g)  # [gq]
        q_pos = torch.tensor(ctx, device=dev).view(b, 1) - rows + row_pos.view(1, gq)  # [b, gq]
        tables = [batch.block_tables[i] for i in seqs]
        k_flat = k_cache.view(-1, hkv, d)
        v_flat = v_cache.view(-1, hkv, d)
        if k_cache.element_size() == 1:  # FP8: gather the bytes (no FP8 index kernels needed)
            k_flat, v_flat = k_flat.view(torch.uint8), v_flat.view(torch.uint8)
            k_raw, v_raw = k_raw.view(torch.uint8), v_raw.view(torch.uint8)
        offs = torch.arange(t, device=dev)
        for t0 in range(0, max(ctx), t):
            # gather this tile's slots for every sequence (null block 0 past a table's end)
            blk = torch.zeros(b, t // bs, dtype=torch.int64)
            for j, table in enumerate(tables):
                part = table[t0 // bs : t0 // bs + t // bs]
                if part:
                    blk[j, : len(part)] = torch.tensor(part, dtype=torch.int64)
            blk = blk.to(dev)
            torch.add(blk.repeat_interleave(bs, dim=1) * bs, (offs % bs).view(1, t), out=slots)
            torch.index_select(k_flat, 0, slots.view(-1), out=k_raw)
            torch.index_select(v_flat, 0, slots.view(-1), out=v_raw)
            # the upcast to fp32 is also the dequantization of an FP8 cache (scale 1)
            kt.copy_(k_raw.view(k_cache.dtype).view(b, t, hkv, d))
            vt.copy_(v_raw.view(v_cache.dtype).view(b, t, hkv, d))
            # scores[b, h, r, c] = q . k
            torch.matmul(qg, kt.permute(0, 2, 3, 1), out=scores)
            key_pos = t0 + offs  # [t]
            torch.gt(key_pos.view(1, 1, 1, t), q_pos.view(b, 1, gq, 1), out=masked)
            scores.masked_fill_(masked, float("-inf"))
            torch.amax(scores, dim=-1, out=m_new)
            torch.maximum(m, m_new, out=m_new)
            scores.sub_(m_new.unsqueeze(-1)).exp_()
            # rescale the running sums by exp(m_old - m_new)
            m.sub_(m_new).exp_()
            torch.sum(scores, dim=-1, out=rowsum)
            denom.mul_(m).add_(rowsum)
            acc.mul_(m.unsqueeze(-1))
            torch.matmul(scores, vt.permute(0, 2, 1, 3), out=pv)
            acc.add_(pv)
            m.copy_(m_new)
        acc.div_(denom.unsqueeze(-1))
        for j, s in enumerate(starts):
            res = acc[j].view(hkv, g, rows, d).permute(2, 0, 1, 3).reshape(rows, hkv * g, d)
            out[s : s + rows].copy_(res)
