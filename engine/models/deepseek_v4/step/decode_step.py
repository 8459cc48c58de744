"""One DeepSeek-V4 decode step (one token for each of B sequences) in one place: the two ways
its layers run (:class:`DecodeLoop`), a layer's decode attention under either, and the fused
layer loop.

* ``DecodeLoop.UNFUSED``: the model's own layer loop (model.py ``_layers``, which prefill
  shares) with :func:`attend_decode_layer` as each layer's attention: PyTorch ops for the
  norms, RoPE and compressors (decode_ops.py), the sparse attention as the backend picks.
* ``DecodeLoop.FUSED``: :func:`fused_decode_layers`, the mHC passes, norms and RoPE as a few
  Triton kernels a layer (fused_ops.py), and the same :func:`attend_decode_layer` taking the
  fused branch; optionally with a side lane (``V4Backend.lanes`` 2, :func:`decode_side`).

The loop is the resolved ``V4Backend.decode`` (backend.py: ``auto`` is fused where the
attention resolves to the kernels); nothing else selects it. Every function here is device
work only: no loop over sequences, no host read of a device value (a CUDA graph replays it).
"""

from __future__ import annotations

import enum

import torch
from torch import nn

from engine.models.deepseek_v4.backend import V4Backend
from engine.models.deepseek_v4.config import SLIDING
from engine.models.deepseek_v4.layers.attention import StepRows, V4Attention, V4CSACompressor
from engine.models.deepseek_v4.layers.decoder import V4Backbone
from engine.models.deepseek_v4.layers.norms import rms_norm_row
from engine.models.deepseek_v4.layers.rope import Rope, V4Rotary, apply_rope_, rotate_
from engine.models.deepseek_v4.memory.kv_pool import DeepseekV4KVPool, LayerPool
from engine.models.deepseek_v4.memory.sizing import fp8_gemv_split_bytes
from engine.models.deepseek_v4.step.decode_ops import (
    attend_decode,
    closed_rows_i32,
    compress_decode,
    compressed_rows,
    indexer_topk_decode,
    write_window,
)
from engine.models.deepseek_v4.step.decode_rows import DecodeRows
from engine.models.deepseek_v4.step.fused_ops import (
    DecodeSide,
    compress_decode_fused,
    fused_indexer_keys,
    indexer_kv_end,
    indexer_topk_fused,
    moe_fused,
    write_window_fused,
)
from engine.models.deepseek_v4.weights.quant_modules import side_semaphores
from engine.side_lane import SideLane
from kernels.hc_decode import hc_decode, hc_decode_partial_shape


class DecodeLoop(enum.Enum):
    """How a decode step runs its layers: the resolved ``V4Backend.decode``."""

    FUSED = "fused"
    UNFUSED = "unfused"

    @classmethod
    def of(cls, backend: V4Backend) -> DecodeLoop:
        assert backend.decode != "auto", "resolve the backend first (V4Backend.resolved)"
        return cls(backend.decode)


def attend_decode_layer(attn: V4Attention, x: torch.Tensor, rope: Rope,
                        compress_rotary: V4Rotary, rows: DecodeRows, cache: LayerPool,
                        backend: V4Backend, inv_rope: Rope | None = None,
                        side: DecodeSide | None = None) -> torch.Tensor:
    """One layer's attention for a step of one token per sequence, all sequences at once:
    x [B, hidden] (row i: the sequence of ``rows`` row i) -> [B, hidden]. The loop
    (:class:`DecodeLoop` of ``backend``) picks the branch: FUSED normalises, rotates and writes
    the window ring with the row kernels, and un-rotates the output with ``inv_rope`` (cos,
    -sin; made once a step by the fused loop, else here); ``side`` (FUSED only): the step's
    side lane, which takes the compressors' updates while the queries are projected."""
    cfg = attn.cfg
    loop = DecodeLoop.of(backend)
    forked = False
    if loop is DecodeLoop.FUSED:
        t, forked = _project_fused(attn, x, rope, rows, cache, compress_rotary, side)
    else:
        t = attn.project(x, rope, backend)
    out = torch.empty_like(t.q)
    if forked:
        assert side is not None
        side.lane.join()  # the entries and the indexer's keys are read from here on
    attend_decode_rows(attn, t, rows, cache, backend, compress_rotary, out, compressed=forked)
    if loop is DecodeLoop.UNFUSED:
        return attn.output(out, *rope)
    inv = inv_rope if inv_rope is not None else (rope[0], -rope[1])
    grouped = attn.o_a_proj(rotate_(out, inv).view(out.shape[0], cfg.o_groups, -1))
    return attn.o_b_proj(grouped)


def attend_decode_rows(attn: V4Attention, t: StepRows, rows: DecodeRows, cache: LayerPool,
                       backend: V4Backend, compress_rotary: V4Rotary, out: torch.Tensor,
                       compressed: bool = False) -> None:
    """One token of each sequence of ``rows`` (t: their projections, row i of ``rows`` row
    i): window ring, compressors, indexer top-k and attention for all of them at once into
    ``out`` [B, H, D]. FUSED: the compressor and indexer through fused_ops.py's kernels.
    ``compressed``: the compressors' updates were issued already (a side lane). A mixed
    step's one-token rows come here too (chunk_attention.py)."""
    cfg = attn.cfg
    fused = DecodeLoop.of(backend) is DecodeLoop.FUSED
    if t.kv is not None:
        write_window(cache, rows, t.kv)
    comp = None
    if attn.compressor is not None:
        assert cache.compressor is not None
        if not compressed:
            _compress(attn, t, rows, cache, compress_rotary, fused)
        topk = None
        if isinstance(attn.compressor, V4CSACompressor):
            ix = attn.compressor.indexer
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
    attend_decode(backend, out, t.q, cache, rows, comp, attn.sinks, cfg.head_dim**-0.5)


def _compress(attn: V4Attention, t: StepRows, rows: DecodeRows, cache: LayerPool,
              compress_rotary: V4Rotary, fused: bool) -> None:
    """The token joins its compressor's (and, CSA, its indexer's) open window; closing rows
    write their entries."""
    compress = compress_decode_fused if fused else compress_decode
    assert attn.compressor is not None and cache.compressor is not None
    assert t.kv_c is not None and t.gate_c is not None
    compress(attn.compressor, t.kv_c, t.gate_c, cache.compressor, rows, compress_rotary)
    if isinstance(attn.compressor, V4CSACompressor):
        assert cache.indexer is not None and t.kv_i is not None and t.gate_i is not None
        compress(attn.compressor.indexer, t.kv_i, t.gate_i, cache.indexer, rows,
                 compress_rotary)


def _project_fused(attn: V4Attention, x: torch.Tensor, rope: Rope, rows: DecodeRows,
                   cache: LayerPool, compress_rotary: V4Rotary,
                   side: DecodeSide | None = None) -> tuple[StepRows, bool]:
    """``V4Attention.project`` of a decode step through the fused row kernels; the shared KV
    goes straight into the window ring (``kv`` None) unless the ring's dtype differs. With a
    ``side`` lane, the compressors' projections and window updates are issued to the side,
    to run while the queries are projected here; -> (rows, whether they were: the caller
    joins the side before reading the projections or the entries)."""
    cfg = attn.cfg
    n, h, d = x.shape[0], cfg.num_heads, cfg.head_dim
    t = StepRows(q=x, kv=None)  # q (and kv) are set below
    forked = side is not None and attn.compressor is not None
    if forked:
        assert side is not None
        # (the compressor's FP8 linears, if any, take the side's scratch and counters; its
        # bf16 GEMM the side stream's cuBLAS workspace, a term of the plan)
        def compressors() -> None:
            attn.project_compressors(x, t)
            _compress(attn, t, rows, cache, compress_rotary, fused=True)

        side.run(compressors, attn.compressor, keep=(x,))
    else:
        attn.project_compressors(x, t)
    q_a, kv = attn.project_x(x)
    q_res = rms_norm_row(q_a, attn.q_a_norm.weight, attn.q_a_norm.eps)
    ix = attn.compressor.indexer if isinstance(attn.compressor, V4CSACompressor) else None
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

        side.run(indexer, attn.compressor, keep=(q_res,))
    t.q = rotate_(attn.q_b_proj(q_res).view(n, h, d), rope, norm=True, eps=cfg.rms_norm_eps)
    written = write_window_fused(cache, rows, kv, attn.kv_norm.weight, attn.kv_norm.eps, rope)
    if not written:
        t.kv = apply_rope_(attn.kv_norm(kv), *rope)
    if ix is not None and not ix_side:
        t.idx_q = rotate_(ix.q_b_proj(q_res).view(n, ix.n_heads, ix.dim), rope)
    return t, forked


def decode_side(owner: nn.Module, rows: DecodeRows, ws: object | None, backend: V4Backend,
                device: torch.device) -> DecodeSide | None:
    """The step's side lane (``backend.lanes`` 2), or None. ``owner`` (the model) keeps the
    lane (one stream, made at the first step: the warm-up) and the FP8 linears' side
    counters. Takes the side's scratch from the caller's open Workspace frame and computes the
    step's shared addressing that both lanes read before anything forks."""
    if backend.lanes < 2:
        return None
    cfg = owner.cfg
    lane = owner.__dict__.get("_side_lane")
    if lane is None or lane.device != device:
        lane = owner.__dict__["_side_lane"] = SideLane(device)
    lane.begin()
    side_ws = None
    sem = side_semaphores(owner)  # made with the FP8 linears' first Workspace binding
    if ws is not None and hasattr(ws, "lane") and sem is not None:
        side_ws = ws.lane(fp8_gemv_split_bytes(cfg, rows.num_rows),
                          caller="deepseek_v4.decode_side_lane")
    _ = rows.writer  # read by both lanes' pool writes: made here, before any fork
    if cfg.uses_csa:
        indexer_kv_end(rows, cfg.csa_rate)  # the side's indexer reads it
    return DecodeSide(lane, side_ws, sem, rows)


def fused_decode_layers(owner: nn.Module, backbone: V4Backbone,
                        rotaries: tuple[V4Rotary, V4Rotary], input_ids: torch.Tensor,
                        rows: DecodeRows, cache: DeepseekV4KVPool, ws: object | None,
                        backend: V4Backend) -> torch.Tensor:
    """The FUSED loop of a decode step: input_ids [B] -> hidden [B, hidden] after the mHC head
    and the final norm. ``rotaries``: (main, compress); ``owner``: the model (its side lane,
    :func:`decode_side`)."""
    cfg = backbone.cfg
    main_rotary, compress_rotary = rotaries
    layers = backbone.layers
    emb = backbone.embed_tokens(input_ids)  # [B, hidden]
    n, m, d = emb.shape[0], cfg.hc_mult, emb.shape[1]
    streams = emb.unsqueeze(1).expand(-1, m, -1).contiguous()  # [B, m, hidden]
    # ping-pong targets of the merges (a merge must not write the streams it reads; the first
    # merge writes bufs[0], the second the embedding's copy): two copies of the streams live,
    # as in the unfused loop. The gates and the block input are rewritten each boundary: every
    # reader runs before the rewrite
    bufs = (torch.empty_like(streams), streams)
    f32 = dict(dtype=torch.float32, device=emb.device)
    partial = torch.empty(hc_decode_partial_shape(n, m, d), **f32)
    head_partial = torch.empty(hc_decode_partial_shape(n, m, d, head=True), **f32)
    post, comb = torch.empty(n, m, **f32), torch.empty(n, m, m, **f32)
    x = torch.empty_like(emb)
    ropes = {}
    for main, rotary in ((True, main_rotary), (False, compress_rotary)):
        cos, sin = rotary(rows.positions, emb.dtype)
        ropes[main] = ((cos, sin), (cos, -sin))  # forward, inverse (the output's un-rotation)
    common = dict(iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)
    side = decode_side(owner, rows, ws, backend, emb.device)

    def boundary(s: torch.Tensor, hc, norm_w: torch.Tensor, out: torch.Tensor | None,
                 k: int) -> torch.Tensor:
        merge = None if out is None else (post, comb, out)
        return hc_decode(s, hc.fn, hc.base, hc.scale, norm_w, **common, partial=partial, x=x,
                         post=post, comb=comb, merge=merge, merged=bufs[k % 2])

    s = boundary(streams, layers[0].attn_hc, layers[0].input_layernorm.weight, None, 0)
    k = 0
    for i, (layer, lc) in enumerate(zip(layers, cache.layers, strict=True)):
        attn = layer.self_attn
        rope, inv = ropes[attn.layer_type == SLIDING]
        a = attend_decode_layer(attn, x, rope, compress_rotary, rows, lc, backend, inv_rope=inv,
                                side=side)
        s = boundary(s, layer.ffn_hc, layer.post_attention_layernorm.weight, a, k)
        k += 1
        mo = moe_fused(layer.mlp, x, input_ids, ws, side)
        if i + 1 < len(layers):
            nxt = layers[i + 1]
            s = boundary(s, nxt.attn_hc, nxt.input_layernorm.weight, mo, k)
            k += 1
    head = backbone.hc_head
    hc_decode(s, head.hc_fn, head.hc_base, head.hc_scale, backbone.norm.weight, **common,
              partial=head_partial, x=x, merge=(post, comb, mo), merged=bufs[k % 2], head=True)
    if side is not None:
        side.lane.close()
    return x
