"""The operations of a batched DeepSeek-V4 decode step in PyTorch (the unfused loop, and the
fused loop's fallbacks): one token for each of B sequences, every part of an attention layer
done for all of them at once (window KV write, compressors, indexer top-k, sparse attention),
addressed by device tensors prepared once per step (:class:`DecodeRows`). decode_step.py
composes them into a layer's decode attention.

Why a separate path: the chunk path (chunk_attention.py) still walks its chunks one by one through
the compressors and the indexer (~50 small kernels per sequence and layer when it walked
everything, which is what a decode step at full depth spent its second on). A mixed step's
one-token sequences come here too (:class:`DecodeSpans`). Here the number of launches per layer does
not depend on B, nothing reads a device value on the host, and every shape depends only on
B and the block-table width, so a step can be captured as a CUDA graph (engine/cuda_graphs.py).

Writes that only some rows make (an entry closes every ``rate`` tokens, a window row lands in
its block only near the block's end) are made by every row; the rows that have nothing to
write aim at the null block 0, which no sequence reads. Must never loop over sequences in
Python, call ``.item()``/``.tolist()``, or build a tensor from host data.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.models.deepseek_v4.backend import V4Backend
from engine.models.deepseek_v4.layers.compressor import V4Compressor
from engine.models.deepseek_v4.layers.rope import V4Rotary, apply_rope
from engine.models.deepseek_v4.memory.kv_pool import CompressorPool, LayerPool
from engine.models.deepseek_v4.memory.paged_rows import PagedRows
from engine.models.deepseek_v4.step.decode_rows import DecodeRows

NULL_ROW = 0  # flat row 0 of any paged tensor is in the null block 0
DECODE_INDEXER_TILE = 2048  # compressed entries scored per tile by the batched indexer


def write_window(cache: LayerPool, rows: DecodeRows, kv: torch.Tensor) -> None:
    """The token's rotated K=V into its slot's window ring. kv: [B, D]. (A block end's window
    snapshot is copied out of the ring after the step: DeepseekV4KVPool.snapshot_from_rings.)"""
    w = cache.ring.shape[1]
    kv = kv[rows.writer]
    ring = cache.ring.view(-1, cache.ring.shape[-1])
    ring.index_copy_(0, rows.ring_rows(w), kv.to(ring.dtype))


def compress_decode(comp: V4Compressor, kv: torch.Tensor, gate: torch.Tensor,
                    cp: CompressorPool, rows: DecodeRows, rotary: V4Rotary) -> None:
    """:meth:`V4Compressor.compress` for one token of each row. kv, gate: [B, width] (the
    compressor's projections). The token joins its slot's open window; rows whose window it
    closes write the window's entry (and, overlapping, its Ca slice) to their blocks."""
    r, d, bs = comp.rate, comp.dim, cp.block_size
    b0, e0 = rows.positions % r, rows.positions // r
    writer = rows.writer
    cp.buf_kv[rows.slots, b0] = kv[writer].to(cp.buf_kv.dtype)
    cp.buf_gate[rows.slots, b0] = gate[writer].to(cp.buf_gate.dtype)
    closing = b0 == r - 1
    ck = cp.buf_kv[rows.slots]  # [B, r, width]; only the closing rows' windows are whole
    cg = cp.buf_gate[rows.slots] + comp.position_bias  # fp32, as the chunk path
    if comp.overlap:
        assert cp.ov_kv is not None and cp.ov_gate is not None
        has_prev = (e0 > 0)[:, None, None]
        prev = rows.block_of((e0 - 1).clamp(min=0) * r, bs)
        pk = torch.where(has_prev, cp.ov_kv[prev], 0)  # [B, r, d]: previous window's Ca slice
        pg = torch.where(has_prev, cp.ov_gate[prev], float("-inf"))
        own = torch.where(closing, rows.block_of(e0 * r, bs), 0)
        cp.ov_kv[own] = ck[writer, :, :d].to(cp.ov_kv.dtype)  # read above: safe to overwrite
        cp.ov_gate[own] = cg[writer, :, :d]
        ck = torch.cat([pk.to(ck.dtype), ck[..., d:]], dim=1)  # [B, 2r, d]
        cg = torch.cat([pg, cg[..., d:]], dim=1)
    weights = cg.softmax(dim=1, dtype=torch.float32).to(ck.dtype)
    entry = comp.kv_norm((ck * weights).sum(dim=1))  # [B, d]
    cos, sin = rotary(e0 * r, entry.dtype)
    dst = rows.entry_rows(e0[:, None], bs // r)[:, 0]
    cp.entries.write(torch.where(closing, dst, NULL_ROW), apply_rope(entry, cos, sin)[writer])


def indexer_topk_decode(q: torch.Tensor, weights: torch.Tensor, keys: PagedRows,
                        rows: DecodeRows, rate: int, block_size: int, topk: int,
                        tile: int = DECODE_INDEXER_TILE,
                        score: Callable[[int, int], torch.Tensor] | None = None) -> torch.Tensor:
    """Top-k indexer entries of each row's own sequence -> [B, topk] int64 (-1 = none).
    q: [B, Hi, Di], weights: [B, Hi] fp32 (scales folded). Score as ``indexer_topk_torch``:
    ``sum_h w[h] * relu(q[h] . k)`` in fp32 over the entries closed by the row's position.
    Walks the table width in tiles with a running top-k: scratch ~ B x Hi x tile, never B x
    Hi x context. ``score(first, num)``: the tile's scores [B, num] (-inf where not visible)
    from elsewhere (fused_ops.py's kernel) instead of the PyTorch ops below."""
    b = q.shape[0]
    per = block_size // rate
    num_entries = rows.tables.shape[1] * per
    qf = q.float()
    best_v = q.new_full((b, 0), float("-inf"), dtype=torch.float32)
    best_i = torch.zeros((b, 0), dtype=torch.long, device=q.device)
    for t0 in range(0, num_entries, tile):
        e, flat, hidden = rows.memo(("indexer_tile", t0, tile, per, rate),
                                    lambda t0=t0: _indexer_tile(rows, t0, tile, num_entries, per, rate))
        if score is not None:
            sc = score(t0, e.shape[1])
        else:
            k = keys.read(flat).view(b, e.shape[1], -1).float()  # [B, T, Di]
            sc = torch.einsum("bhd,btd->bht", qf, k)
            sc = (F.relu(sc) * weights[:, :, None]).sum(dim=1)  # [B, T]
            sc = sc.masked_fill(hidden, float("-inf"))
        cand_v = torch.cat([best_v, sc], dim=1)
        cand_i = torch.cat([best_i, e], dim=1)
        best_v, pos = cand_v.topk(min(topk, cand_v.shape[1]), dim=1)
        best_i = cand_i.gather(1, pos)
    idx = torch.where(torch.isinf(best_v), -1, best_i)
    if idx.shape[1] < topk:
        idx = F.pad(idx, (0, topk - idx.shape[1]), value=-1)
    return idx


def _indexer_tile(rows: DecodeRows, t0: int, tile: int, num_entries: int, per: int, rate: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Entries ``[t0, t0 + tile)`` of every row: (numbers [B, T], flat pool rows [B * T], not yet
    closed at the row's position [B, T])."""
    e = torch.arange(t0, min(t0 + tile, num_entries), device=rows.tables.device)
    e = e[None, :].expand(rows.num_rows, -1)
    return e, rows.entry_rows(e, per).flatten(), e >= ((rows.positions + 1) // rate)[:, None]


def compressed_rows(cp: CompressorPool, rows: DecodeRows, topk_idx: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat pool rows [B, K], visible [B, K] bool) of the compressed entries each row attends:
    CSA the indexer's top-k (``topk_idx``), HCA every entry closed by the row's position."""
    per = cp.block_size // cp.rate
    if topk_idx is not None:
        return rows.entry_rows(topk_idx.clamp(min=0), per), topk_idx >= 0

    def every_closed() -> tuple[torch.Tensor, torch.Tensor]:
        e = torch.arange(rows.tables.shape[1] * per, device=rows.tables.device)[None, :]
        e = e.expand(rows.num_rows, -1)
        return rows.entry_rows(e, per), e < ((rows.positions + 1) // cp.rate)[:, None]

    return rows.memo(("every_closed", per, cp.rate), every_closed)


def closed_rows_i32(cp: CompressorPool, rows: DecodeRows) -> torch.Tensor:
    """:func:`compressed_rows` of an HCA layer (every closed entry) as the attention kernel
    takes a bf16 pool's rows: int32 pool rows [B, K], -1 for none. Once a step for all the
    layers of one rate and block size (their pools share the addressing)."""
    per = cp.block_size // cp.rate

    def build() -> torch.Tensor:
        crow, visible = compressed_rows(cp, rows, None)
        return torch.where(visible, crow, -1).to(torch.int32)

    return rows.memo(("closed_i32", per, cp.rate), build)


def attend_decode(backend: V4Backend, out: torch.Tensor, q: torch.Tensor, cache: LayerPool,
                  rows: DecodeRows,
                  comp: tuple[PagedRows, torch.Tensor, torch.Tensor | None] | None,
                  sinks: torch.Tensor, scale: float) -> None:
    """Sliding window (the slot's ring, already holding this token) + the given compressed
    entries (pool, rows [B, K], visible [B, K]; visible None: rows are int32 with -1 for none,
    the fused indexer's answer) for every row at once into ``out`` [B, H, D]."""
    w, dim = cache.ring.shape[1], cache.ring.shape[-1]
    if comp is not None and comp[2] is None:
        pool, crow, _ = comp
        # the kernel takes a bf16 pool's rows as they are; otherwise rows + visibility
        if backend.attention == "torch" or pool.scale is not None:
            comp = (pool, crow.clamp(min=0).long(), crow >= 0)
    # ring rows holding positions (pos - W, pos]
    filled = rows.memo(("filled", w), lambda: (rows.positions + 1).clamp(max=w))
    if backend.attention == "torch":
        win = cache.ring[rows.slots]  # [B, W, D]
        keys, valid = win, torch.arange(w, device=q.device)[None, :] < filled[:, None]
        if comp is not None:
            pool, crow, cvis = comp
            assert cvis is not None
            keys = torch.cat([win, pool.read(crow.flatten()).view(*crow.shape, dim)], dim=1)
            valid = torch.cat([valid, cvis], dim=1)
        out.copy_(decode_attention_torch(q, keys, valid, sinks, scale))
        return
    kw: dict[str, torch.Tensor] = {}
    if comp is not None:
        pool, crow, cvis = comp
        if pool.scale is None:  # the pool's own rows: nothing gathered
            kw["compressed_kv"] = pool.data.view(-1, dim)
            kw["indices"] = crow if cvis is None else torch.where(cvis, crow, -1).to(torch.int32)
        else:  # FP8 entries: dequantise the attended rows into one table
            assert cvis is not None
            kw["compressed_kv"] = pool.read(crow.flatten())
            flat = rows.memo(("flat", crow.numel()), lambda: torch.arange(
                crow.numel(), device=q.device).view(crow.shape))
            kw["indices"] = torch.where(cvis, flat, -1).to(torch.int32)
    start, end = rows.memo(("window_bounds", w), lambda: (
        (rows.slots * w).to(torch.int32), (rows.slots * w + filled).to(torch.int32)))
    if backend.attention == "kernels_ref":
        from kernels.sparse_attention_ref import sparse_attention_ref

        sparse_attention_ref(q, cache.ring.view(-1, dim), start, end, scale=scale, out=out,
                             sinks=sinks, **kw)
        return
    from kernels.sparse_attention import decode_attention_splits, sparse_attention

    # the entry lists split over more programs where few rows leave SMs idle (static per layer
    # and batch size: window + this layer's compressed width)
    entries = w + (kw["indices"].shape[1] if "indices" in kw else 0)
    sparse_attention(q, cache.ring.view(-1, dim), start, end, scale=scale, out=out, sinks=sinks,
                     num_splits=decode_attention_splits(q.shape[0], q.shape[1], entries), **kw)


def decode_attention_torch(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor,
                           sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """Readable reference of one decode row per sequence. q: [B, H, D]; keys (= values):
    [B, K, D]; valid: [B, K]. Softmax in fp32 with the per-head sink as an extra logit that
    joins the denominator only. Returns [B, H, D] in q's dtype."""
    kf = keys.float()
    s = torch.einsum("bhd,bkd->bhk", q.float(), kf) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    sink = sinks.float()[None, :, None].expand(q.shape[0], q.shape[1], 1)
    logits = torch.cat([s, sink], dim=-1)
    probs = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)
    return torch.einsum("bhk,bkd->bhd", probs[..., :-1], kf).to(q.dtype)
