"""A DeepSeek-V4 layer's attention over a step's prefill chunks (several tokens of a sequence
each), and the step's one-token rows beside them (a mixed step), into one output.

The chunks' window ring, window snapshots, entry reads and the attention's bounds are one op
each for all chunks (``ChunkRows``: the step's addressing, chunk_rows.py); the compressors and
the indexer's top-k still go chunk by chunk, since their windows and key ranges differ in
length per sequence. A mixed step's one-token rows are attended as a decode step
(decode_step.py), with the decode loop the backend resolves to. Reads and writes each
sequence's blocks, window snapshots and slot carry in the pool; never allocates cache memory.
"""

from __future__ import annotations

import contextlib

import torch

from engine.models.deepseek_v4.backend import V4Backend
from engine.models.deepseek_v4.layers.attention import StepRows, V4Attention, V4CSACompressor
from engine.models.deepseek_v4.layers.indexer import select_topk
from engine.models.deepseek_v4.layers.rope import Rope, V4Rotary
from engine.models.deepseek_v4.layers.sparse_attention import v4_attention_torch
from engine.models.deepseek_v4.memory.kv_pool import LayerPool
from engine.models.deepseek_v4.step.chunk_rows import ChunkRows, attend_chunks
from engine.models.deepseek_v4.step.decode_rows import DecodeSpans
from engine.models.deepseek_v4.step.decode_step import attend_decode_rows
from engine.models.deepseek_v4.step.rows import SeqSpan


def attend_step(attn: V4Attention, x: torch.Tensor, rope: Rope, compress_rotary: V4Rotary,
                spans: list[SeqSpan], cache: LayerPool, backend: V4Backend,
                ws: object | None = None, decode: DecodeSpans | None = None,
                chunks: ChunkRows | None = None) -> torch.Tensor:
    """x: [N, hidden] (already input-normed); rope: this layer's (cos, sin) [N, R/2] at the
    tokens' positions. ``spans``: the step's sequences of several tokens (prefill chunks),
    addressed by ``chunks``; ``decode``: its one-token sequences, attended all at once as a
    decode step (decode_step.py). Returns [N, hidden]."""
    cos, sin = rope
    t = attn.project(x, rope, backend)
    out = torch.empty_like(t.q)
    if spans:
        assert chunks is not None
        _attend_chunks(attn, t, out, compress_rotary, spans, chunks, cache, backend, ws)
    if decode is not None:
        # after the chunks: their batched call writes (empty) rows here too
        index = decode.index
        dst = out[index] if isinstance(index, slice) else out.new_empty(
            (decode.rows.num_rows, *out.shape[1:]))
        attend_decode_rows(attn, t.select(index), decode.rows, cache, backend, compress_rotary,
                           dst)
        if not isinstance(index, slice):
            out.index_copy_(0, index, dst)
    return attn.output(out, cos, sin, backend.attention == "kernels")


def _attend_chunks(attn: V4Attention, t: StepRows, out: torch.Tensor, compress_rotary: V4Rotary,
                   spans: list[SeqSpan], chunks: ChunkRows, cache: LayerPool,
                   backend: V4Backend, ws: object | None) -> None:
    """The chunks' state updates and attention into their rows of ``out`` [N, H, D]. Window
    ring, window snapshots, entry reads and the attention's bounds: one op each for all
    chunks (``chunks``: the step's addressing). The compressors and the indexer's top-k
    still go chunk by chunk: their windows and key ranges differ in length per sequence.
    Its own function so that the window table and entries are freed on return."""
    cfg = attn.cfg
    assert t.kv is not None
    table = chunks.window_table(cache.ring, t.kv)  # before the ring write: the old keys
    chunks.write_ring(cache.ring, t.kv)
    if chunks.snapshot is not None:  # the windows at the block ends the chunks reach
        src, dst = chunks.snapshot
        cache.windows.layers[cache.index].write(dst, table.index_select(0, src))
    comp = topk = None
    local: list[torch.Tensor | None] = [None] * len(spans)
    batched = backend.attention != "torch"
    if attn.compressor is not None:
        assert cache.compressor is not None
        assert t.kv_c is not None and t.gate_c is not None
        rr = chunks.rates[attn.rate]
        csa = isinstance(attn.compressor, V4CSACompressor)
        if csa and batched:
            topk = torch.full((out.shape[0], cfg.index_topk), -1, dtype=torch.int32,
                              device=out.device)
        for i, sp in enumerate(spans):
            sl = slice(sp.begin, sp.end)
            attn.compressor.compress(t.kv_c[sl], t.gate_c[sl], cache.compressor, sp.slot,
                                     sp.start_pos, compress_rotary, sp.table)
            if not csa:
                continue
            ix = attn.compressor.indexer
            assert cache.indexer is not None and t.kv_i is not None and t.gate_i is not None
            assert t.idx_q is not None and t.idx_w is not None
            ix.compress(t.kv_i[sl], t.gate_i[sl], cache.indexer, sp.slot, sp.start_pos,
                        compress_rotary, sp.table)
            base, num = rr.bases[i], rr.num_entries[i]
            # one Workspace frame per sequence: its indexer scratch is reused by the next one
            scope = ws.scope() if ws is not None else contextlib.nullcontext()  # type: ignore[attr-defined]
            with scope:
                keys = cache.indexer.entries.read(rr.entry_rows[base : base + num])
                idx = select_topk(backend, t.idx_q[sl], keys, t.idx_w[sl], rr.kv_end[sl],
                                  cfg.index_topk, ws)
                if topk is not None:  # copied out of the Workspace frame before it closes
                    topk[sl] = torch.where(idx >= 0, idx + base, -1)
                else:
                    local[i] = idx.clone() if ws is not None else idx
        comp = cache.compressor.entries.read(rr.entry_rows)  # [E, D]: every chunk's entries
    scale = cfg.head_dim**-0.5
    if batched:
        attend_chunks(backend, out, t.q, table, chunks, comp, topk, attn.sinks, scale,
                      attn.rate)
        return
    for i, sp in enumerate(spans):  # the readable reference path (CPU)
        off, prev = chunks.offsets[i], chunks.num_prev[i]
        comp_i = None
        if comp is not None:
            rr = chunks.rates[attn.rate]
            comp_i = comp[rr.bases[i] : rr.bases[i] + rr.num_entries[i]]
        out[sp.begin : sp.end] = v4_attention_torch(
            t.q[sp.begin : sp.end], table[off : off + prev + sp.end - sp.begin], prev,
            cfg.sliding_window, attn.sinks, scale, sp.start_pos, comp=comp_i,
            comp_rate=attn.rate, topk_idx=local[i],
        )
