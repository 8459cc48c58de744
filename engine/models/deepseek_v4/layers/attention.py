"""One DeepSeek-V4 attention block (sliding, CSA or HCA): low-rank queries, shared-KV MQA with
head_dim 512, partial interleaved RoPE, per-head sinks, grouped output projection.

Parameter names follow transformers' ``DeepseekV4Attention``. Reads and writes each sequence's
blocks, window snapshots and slot carry in :class:`DeepseekV4KVPool`; never allocates cache memory.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from engine.models.deepseek_v4.backend import V4Backend, select_topk
from engine.models.deepseek_v4.config import CSA, SLIDING, DeepseekV4Config
from engine.models.deepseek_v4.layers.compressor import V4Compressor
from engine.models.deepseek_v4.layers.indexer import V4Indexer
from engine.models.deepseek_v4.layers.merged_linear import MergedLinear
from engine.models.deepseek_v4.layers.norms import RMSNorm, unweighted_rms_norm
from engine.models.deepseek_v4.layers.rope import V4Rotary, apply_rope_
from engine.models.deepseek_v4.layers.sparse_attention import v4_attention_torch
from engine.models.deepseek_v4.memory.kv_pool import LayerPool
from engine.models.deepseek_v4.step.chunk_rows import ChunkRows, attend_chunks
from engine.models.deepseek_v4.step.decode_ops import (
    DecodeRows,
    DecodeSpans,
    attend_decode,
    closed_rows_i32,
    compress_decode,
    compressed_rows,
    indexer_topk_decode,
    write_window,
)
from engine.models.deepseek_v4.step.fused_ops import (
    DecodeSide,
    compress_decode_fused,
    fused_indexer_keys,
    indexer_topk_fused,
    rms_norm_row,
    rope_norm_,
    rotate_,
    write_window_fused,
)
from engine.models.deepseek_v4.step.rows import SeqSpan, StepRows


class V4CSACompressor(V4Compressor):
    """CSA's overlapping compressor; owns the indexer (transformers: ``compressor.indexer``)."""

    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__(cfg.hidden_size, cfg.head_dim, cfg.csa_rate, True, cfg.rms_norm_eps)
        self.indexer = V4Indexer(cfg)


class GroupedLinear(nn.Module):
    """Block-diagonal projection: ``weight [groups * out_per_group, in_per_group]``."""

    def __init__(self, in_per_group: int, out_features: int, groups: int) -> None:
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(out_features, in_per_group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, groups, in_per_group] -> [N, groups * out_per_group]
        w = self.weight.view(self.groups, -1, x.shape[-1])  # [G, out/G, in]
        return torch.einsum("ngi,goi->ngo", x, w).flatten(1)


class V4Attention(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, layer_idx: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_type = cfg.layer_types[layer_idx]
        self.is_main_rope = self.layer_type == SLIDING
        h, d = cfg.num_heads, cfg.head_dim
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * d, bias=False)
        self.kv_proj = nn.Linear(cfg.hidden_size, d, bias=False)
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.o_a_proj = GroupedLinear(h * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, cfg.o_groups)
        self.o_b_proj = nn.Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.zeros(h, dtype=torch.float32))
        self.compressor: V4Compressor | None = None
        if self.layer_type == CSA:
            self.compressor = V4CSACompressor(cfg)
        elif self.layer_type != SLIDING:
            self.compressor = V4Compressor(
                cfg.hidden_size, d, cfg.hca_rate, False, cfg.rms_norm_eps
            )
        # one GEMM for the projections of x (merged_linear.py, set when the model is finalized):
        # q_a_proj + kv_proj, and the compressor's (+ the indexer's) kv / gate / weights_proj
        self.merged_x: MergedLinear | None = None
        self.merged_comp: MergedLinear | None = None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        compress_rotary: V4Rotary,
        spans: list[SeqSpan],
        cache: LayerPool,
        backend: V4Backend,
        ws: object | None = None,
        decode: DecodeSpans | None = None,
        chunks: ChunkRows | None = None,
    ) -> torch.Tensor:
        """x: [N, hidden] (already input-normed); rope: this layer's (cos, sin) [N, R/2] at the
        tokens' positions. ``spans``: the step's sequences of several tokens (prefill chunks),
        addressed by ``chunks``; ``decode``: its one-token sequences, attended all at once as a
        decode step (decode_step.py). Returns [N, hidden]."""
        cos, sin = rope
        t = self._project(x, rope, backend)
        out = torch.empty_like(t.q)
        if spans:
            assert chunks is not None
            self._attend_chunks(t, out, compress_rotary, spans, chunks, cache, backend, ws)
        if decode is not None:
            # after the chunks: their batched call writes (empty) rows here too
            index = decode.index
            dst = out[index] if isinstance(index, slice) else out.new_empty(
                (decode.rows.num_rows, *out.shape[1:]))
            self._attend_rows(t.select(index), decode.rows, cache, backend, compress_rotary, dst,
                              fused=backend.decode == "fused")
            if not isinstance(index, slice):
                out.index_copy_(0, index, dst)
        return self._output(out, cos, sin, backend.attention == "kernels")

    def _attend_chunks(self, t: StepRows, out: torch.Tensor, compress_rotary: V4Rotary,
                       spans: list[SeqSpan], chunks: ChunkRows, cache: LayerPool,
                       backend: V4Backend, ws: object | None) -> None:
        """The chunks' state updates and attention into their rows of ``out`` [N, H, D]. Window
        ring, window snapshots, entry reads and the attention's bounds: one op each for all
        chunks (``chunks``: the step's addressing). The compressors and the indexer's top-k
        still go chunk by chunk: their windows and key ranges differ in length per sequence.
        Its own function so that the window table and entries are freed on return."""
        cfg = self.cfg
        assert t.kv is not None
        table = chunks.window_table(cache.ring, t.kv)  # before the ring write: the old keys
        chunks.write_ring(cache.ring, t.kv)
        if chunks.snapshot is not None:  # the windows at the block ends the chunks reach
            src, dst = chunks.snapshot
            cache.windows.layers[cache.index].write(dst, table.index_select(0, src))
        comp = topk = None
        local: list[torch.Tensor | None] = [None] * len(spans)
        batched = backend.attention != "torch"
        if self.compressor is not None:
            assert cache.compressor is not None
            assert t.kv_c is not None and t.gate_c is not None
            rr = chunks.rates[self._rate]
            csa = isinstance(self.compressor, V4CSACompressor)
            if csa and batched:
                topk = torch.full((out.shape[0], cfg.index_topk), -1, dtype=torch.int32,
                                  device=out.device)
            for i, sp in enumerate(spans):
                sl = slice(sp.begin, sp.end)
                self.compressor.compress(t.kv_c[sl], t.gate_c[sl], cache.compressor, sp.slot,
                                         sp.start_pos, compress_rotary, sp.table)
                if not csa:
                    continue
                ix = self.compressor.indexer
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
            attend_chunks(backend, out, t.q, table, chunks, comp, topk, self.sinks, scale,
                          self._rate)
            return
        for i, sp in enumerate(spans):  # the readable reference path (CPU)
            off, prev = chunks.offsets[i], chunks.num_prev[i]
            comp_i = None
            if comp is not None:
                rr = chunks.rates[self._rate]
                comp_i = comp[rr.bases[i] : rr.bases[i] + rr.num_entries[i]]
            out[sp.begin : sp.end] = v4_attention_torch(
                t.q[sp.begin : sp.end], table[off : off + prev + sp.end - sp.begin], prev,
                cfg.sliding_window, self.sinks, scale, sp.start_pos, comp=comp_i,
                comp_rate=self._rate, topk_idx=local[i],
            )

    def forward_decode(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], compress_rotary: V4Rotary,
        rows: DecodeRows, cache: LayerPool, backend: V4Backend,
        inv_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        side: DecodeSide | None = None,
    ) -> torch.Tensor:
        """:meth:`forward` for a step of one token per sequence, all sequences at once
        (decode_step.py): x [B, hidden] (row i: the sequence of ``rows`` row i). -> [B, hidden].
        ``inv_rope`` (cos, -sin): the fused decode path (decode_fused.py), whose row kernels
        normalise, rotate and write the window ring. ``side`` (fused only): the step's side
        lane, which takes the compressors' updates while the queries are projected."""
        cfg = self.cfg
        fused = inv_rope is not None
        forked = False
        if fused:
            t, forked = self._project_fused(x, rope, rows, cache, compress_rotary, side)
        else:
            t = self._project(x, rope, backend)
        out = torch.empty_like(t.q)
        if forked:
            assert side is not None
            side.lane.join()  # the entries and the indexer's keys are read from here on
        self._attend_rows(t, rows, cache, backend, compress_rotary, out, fused, compressed=forked)
        if fused:
            assert inv_rope is not None
            grouped = self.o_a_proj(rotate_(out, inv_rope).view(out.shape[0], cfg.o_groups, -1))
            return self.o_b_proj(grouped)
        return self._output(out, *rope)

    def _compress(self, t: StepRows, rows: DecodeRows, cache: LayerPool,
                  compress_rotary: V4Rotary, fused: bool) -> None:
        """The token joins its compressor's (and, CSA, its indexer's) open window; closing
        rows write their entries."""
        compress = compress_decode_fused if fused else compress_decode
        assert self.compressor is not None and cache.compressor is not None
        assert t.kv_c is not None and t.gate_c is not None
        compress(self.compressor, t.kv_c, t.gate_c, cache.compressor, rows, compress_rotary)
        if isinstance(self.compressor, V4CSACompressor):
            assert cache.indexer is not None and t.kv_i is not None and t.gate_i is not None
            compress(self.compressor.indexer, t.kv_i, t.gate_i, cache.indexer, rows,
                     compress_rotary)

    def _attend_rows(self, t: StepRows, rows: DecodeRows, cache: LayerPool, backend: V4Backend,
                     compress_rotary: V4Rotary, out: torch.Tensor, fused: bool,
                     compressed: bool = False) -> None:
        """One token of each sequence of ``rows`` (t: their projections, row i of ``rows`` row
        i): window ring, compressors, indexer top-k and attention for all of them at once into
        ``out`` [B, H, D]. ``fused``: the compressor and indexer through decode_fused.py's
        kernels. ``compressed``: the compressors' updates were issued already (a side lane)."""
        cfg = self.cfg
        if t.kv is not None:
            write_window(cache, rows, t.kv)
        comp = None
        if self.compressor is not None:
            assert cache.compressor is not None
            if not compressed:
                self._compress(t, rows, cache, compress_rotary, fused)
            topk = None
            if isinstance(self.compressor, V4CSACompressor):
                ix = self.compressor.indexer
                assert cache.indexer is not None
                assert t.idx_q is not None and t.idx_w is not None
                if fused:  # the picks come back as pool rows, -1 for none
                    crow = t.picks if t.picks is not None else indexer_topk_fused(
                        t.idx_q, t.idx_w, cache.indexer.entries, rows, ix.rate,
                        cache.block_size, cfg.index_topk)
                    comp = (cache.compressor.entries, crow, None)
                else:
                    topk = indexer_topk_decode(t.idx_q, t.idx_w, cache.indexer.entries, rows,
                                               ix.rate, cache.block_size, cfg.index_topk)
            if comp is None and topk is None and cache.compressor.entries.scale is None \
                    and backend.attention != "torch":  # HCA: the kernel's rows, once a step
                comp = (cache.compressor.entries, closed_rows_i32(cache.compressor, rows), None)
            if comp is None:
                crow, visible = compressed_rows(cache.compressor, rows, topk)
                comp = (cache.compressor.entries, crow, visible)
        attend_decode(backend, out, t.q, cache, rows, comp, self.sinks, cfg.head_dim**-0.5)

    def _project_fused(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                       rows: DecodeRows, cache: LayerPool, compress_rotary: V4Rotary,
                       side: DecodeSide | None = None) -> tuple[StepRows, bool]:
        """:meth:`_project` of a decode step through the fused row kernels; the shared KV goes
        straight into the window ring (``kv`` None) unless the ring's dtype differs. With a
        ``side`` lane, the compressors' projections and window updates are issued to the side,
        to run while the queries are projected here; -> (rows, whether they were: the caller
        joins the side before reading the projections or the entries)."""
        cfg = self.cfg
        n, h, d = x.shape[0], cfg.num_heads, cfg.head_dim
        t = StepRows(q=x, kv=None)  # q (and kv) are set below
        forked = side is not None and self.compressor is not None
        if forked:
            assert side is not None
            # (the compressor's FP8 linears, if any, take the side's scratch and counters; its
            # bf16 GEMM the side stream's cuBLAS workspace, a term of the plan)
            def compressors() -> None:
                self._project_compressors(x, t)
                self._compress(t, rows, cache, compress_rotary, fused=True)

            side.run(compressors, self.compressor, keep=(x,))
        else:
            self._project_compressors(x, t)
        q_a, kv = self._project_x(x)
        q_res = rms_norm_row(q_a, self.q_a_norm.weight, self.q_a_norm.eps)
        ix = self.compressor.indexer if isinstance(self.compressor, V4CSACompressor) else None
        ix_side = (ix is not None and forked and cache.indexer is not None
                   and fused_indexer_keys(cache.indexer.entries, x.dtype))
        if ix_side:
            assert side is not None and ix is not None and cache.indexer is not None
            # the indexer's queries and top-k follow its keys on the side once q_a's norm is
            # done here (this fork waits for it), beside the queries' own projection
            def indexer() -> None:
                assert ix is not None and cache.indexer is not None and t.idx_w is not None
                t.idx_q = rotate_(ix.q_b_proj(q_res).view(n, ix.n_heads, ix.dim), rope)
                t.picks = indexer_topk_fused(t.idx_q, t.idx_w, cache.indexer.entries, rows,
                                             ix.rate, cache.block_size, cfg.index_topk)

            side.run(indexer, self.compressor, keep=(q_res,))
        t.q = rotate_(self.q_b_proj(q_res).view(n, h, d), rope, norm=True, eps=cfg.rms_norm_eps)
        written = write_window_fused(cache, rows, kv, self.kv_norm.weight, self.kv_norm.eps, rope)
        if not written:
            t.kv = apply_rope_(self.kv_norm(kv), *rope)  # type: ignore[arg-type]
        if ix is not None and not ix_side:
            t.idx_q = rotate_(ix.q_b_proj(q_res).view(n, ix.n_heads, ix.dim), rope)
        return t, forked

    def _project_x(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q_a_proj(x), kv_proj(x): one GEMM when merged (views of its output)."""
        if self.merged_x is not None:
            q_a, kv = self.merged_x(x)
            return q_a, kv
        return self.q_a_proj(x), self.kv_proj(x)

    def _project_compressors(self, x: torch.Tensor, t: StepRows) -> None:
        """The compressor's kv / gate projections of x into ``t`` and, in CSA layers, the
        indexer's kv / gate and score weights: one GEMM when merged (views of its output)."""
        comp = self.compressor
        if comp is None:
            return
        csa = isinstance(comp, V4CSACompressor)
        if self.merged_comp is None:
            t.kv_c, t.gate_c = comp.project(x)
            if csa:
                t.kv_i, t.gate_i = comp.indexer.project(x)
                t.idx_w = comp.indexer.score_weights(x)
            return
        outs = self.merged_comp(x)
        t.kv_c, t.gate_c = outs[0], outs[1]
        if csa:
            t.kv_i, t.gate_i = outs[2], outs[3]
            t.idx_w = comp.indexer.scale_scores(outs[4])

    def _project(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 backend: V4Backend) -> StepRows:
        """Every per-token projection of the step (queries, shared KV, compressor and indexer
        inputs); x: [N, hidden] (already input-normed)."""
        cfg = self.cfg
        n = x.shape[0]
        h, d = cfg.num_heads, cfg.head_dim
        cos, sin = rope
        kernels = backend.attention == "kernels"
        q_a, kv_raw = self._project_x(x)  # one GEMM when merged (views of its output)
        if kernels:
            # one pass a tensor (norm + rope in fp32, rounded once), as the fused decode path:
            # in PyTorch the rope of the [N, H, D] queries alone is ~10 fp32 temporaries of
            # [N, H, R/2] (~350 MiB written at a 4096-token chunk), the norms an fp32 copy each
            q_res = rms_norm_row(q_a, self.q_a_norm.weight, self.q_a_norm.eps)
            q = rotate_(self.q_b_proj(q_res).view(n, h, d), rope, norm=True, eps=cfg.rms_norm_eps)
            kv = rope_norm_(kv_raw, rope, self.kv_norm.weight, self.kv_norm.eps)
        else:
            q_res = self.q_a_norm(q_a)  # [N, q_lora_rank]
            q = unweighted_rms_norm(self.q_b_proj(q_res).view(n, h, d), cfg.rms_norm_eps)
            q = apply_rope_(q, cos, sin)  # [N, H, D] (fresh tensors: rotated in place)
            kv = apply_rope_(self.kv_norm(kv_raw), cos, sin)  # [N, D]
        t = StepRows(q=q, kv=kv)
        self._project_compressors(x, t)
        if isinstance(self.compressor, V4CSACompressor):
            t.idx_q = self.compressor.indexer.index_queries(q_res, cos, sin, kernels)
        return t

    def _output(self, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kernels: bool = False) -> torch.Tensor:
        """Attention output [N, H, D] -> [N, hidden]: undo the rotation V picked up (K == V),
        then the grouped low-rank output projection (``kernels``: the rotation as one launch)."""
        out = rotate_(out, (cos, -sin)) if kernels else apply_rope_(out, cos, -sin)
        grouped = self.o_a_proj(out.view(out.shape[0], self.cfg.o_groups, -1))
        return self.o_b_proj(grouped)

    @property
    def _rate(self) -> int:
        return 0 if self.compressor is None else self.compressor.rate
