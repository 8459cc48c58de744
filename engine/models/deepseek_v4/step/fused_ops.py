"""The fused operations of a DeepSeek-V4 decode step (CUDA, or the Triton interpreter), which
the fused loop (decode_step.py, ``DecodeLoop.FUSED``) runs: a few launches where the unfused
loop makes hundreds.

* mHC between two blocks (called by the loop itself): ``kernels.hc_decode`` merges the previous block into the streams and
  computes the next block's gates, Sinkhorn matrix, collapse and input RMSNorm (2 launches
  instead of ~25); the last one collapses through the model's head and applies its final norm.
* each compressor (and the indexer's): ``kernels.compress_decode``, the window update, the
  gated sum, norm and RoPE of a closed window's entry and its pool row (2 launches, not ~40;
  a third, the pool write, where the pool is FP8).
* the CSA indexer: ``kernels.indexer_decode`` scores a tile of entries a launch (instead of a
  key gather, a copy, a matmul and four elementwise kernels) and merges it into the running
  top-k on the device (instead of a concatenation, ``torch.topk``'s sort and a gather).
* the MoE's routing and its shared expert's clamped SwiGLU: ``kernels.moe_decode`` (one
  launch each instead of ~10 and ~5; the routing takes the router's linear into the same
  launch up to ``FUSED_ROUTER_MAX_ROWS`` rows where the model has split-K counters, i.e.
  FP8 shared experts with a workspace);
  the experts themselves are the fused MXFP4 kernels.
* the attention's row work: ``kernels.rope_norm`` for q_a's RMSNorm, the queries' norm + RoPE,
  the shared KV's norm + RoPE written straight into the window ring, the indexer queries' RoPE
  and the output's inverse RoPE (1 launch each instead of ~10).

* the projections of one input: ``q_a_proj`` + ``kv_proj`` and the shared expert's
  ``gate_proj`` + ``up_proj`` as one FP8 GEMV each, the compressors' bf16 projections as one
  GEMM (layers/merged_groups.py, formed at load where the scale grids allow; outputs split by views).
* two lanes (``V4Backend.lanes`` 2, opt-in until a GPU has run it; engine/side_lane.py):
  work off the main chain runs on a second stream beside it. In attention, the compressors' projections (one
  bf16 GEMM), window updates and entries run while the queries are projected, normalised and
  rotated and the window ring written; in CSA layers the indexer's queries (its q_b GEMV
  and RoPE, once q_a's norm is done: the side waits for it) and its top-k follow there. The
  lane is joined before the sparse attention reads the entries and picks (the side stream's
  cuBLAS workspace is a term of the plan). In the MoE, the shared expert (its gate-up GEMV,
  SwiGLU, down GEMV) runs while the routing and the routed experts' GEMVs do; the lane is
  joined right before the experts' combine adds into the shared expert's output. The side's
  split-K GEMVs take their partials from a Workspace carved from the step's frame
  (``fp8_gemv_split_bytes`` at the step's rows) and count slices in their own set of
  counters, so nothing the two lanes use at once is shared.

Decode only (one token per sequence; the row kernels' wrappers ``rms_norm_row``, ``rotate_``
and ``rope_norm_`` live with the layers, in norms.py and rope.py, since prefill uses them too)
and numerically the same
formulas as the unfused step, rounded at the same points; reductions run in another order, so
results agree to rounding, not bit for bit. Must never loop over sequences or read device
values on the host (the step is captured as a CUDA graph).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.models.deepseek_v4.layers.compressor import V4Compressor
from engine.models.deepseek_v4.layers.moe import V4MoE
from engine.models.deepseek_v4.layers.rope import Rope, V4Rotary
from engine.models.deepseek_v4.memory.kv_pool import CompressorPool, LayerPool
from engine.models.deepseek_v4.memory.paged_rows import PagedRows
from engine.models.deepseek_v4.step.decode_ops import compress_decode, indexer_topk_decode
from engine.models.deepseek_v4.step.decode_rows import DecodeRows
from engine.models.deepseek_v4.weights.quant_modules import Fp8Linear, Mxfp4Experts, rebind
from engine.side_lane import SideLane
from kernels.compress_decode import compress_decode as compress_decode_kernel
from kernels.indexer_decode import indexer_decode_topk
from kernels.moe_decode import FUSED_ROUTER_MAX_ROWS, clamped_swiglu, moe_route, moe_router
from kernels.rope_norm import rope_norm


class DecodeSide:
    """A fused decode step's side lane: the model's :class:`SideLane` (one stream, made at
    the first step: the warm-up), the Workspace carved from the step's frame for the side's
    split-K partials and the side's split-K counters. Built by :func:`decode_side`."""

    def __init__(self, lane: SideLane, ws: object | None, semaphores: torch.Tensor | None,
                 rows: DecodeRows) -> None:
        self.lane, self.ws, self.semaphores, self.rows = lane, ws, semaphores, rows

    def run(self, fn: Callable[[], None], module: torch.nn.Module | None = None,
            keep: tuple[object, ...] = ()) -> None:
        """``fn()`` issued to the side; ``module``'s FP8 linears take the side's scratch and
        counters meanwhile. The step's shared addressing must not grow inside. ``fn`` leaves
        its results in place (the caller reads them after the join)."""
        bind = None if module is None else (
            lambda: rebind(module, self.ws, self.semaphores))
        self.lane.run(fn, bind=bind, frozen=self.rows.shared_keys, keep=keep)

    @staticmethod
    def takes_shared_expert(se: torch.nn.Module) -> bool:
        """Whether the shared expert ``se`` may run on the side: its down projection is an FP8
        linear, which writes into the output made before the fork (``Fp8Linear(out=)``). (A
        library GEMM there uses the side stream's cuBLAS workspace, a term of the plan.)"""
        return isinstance(getattr(se, "down_proj", None), Fp8Linear)



def write_window_fused(cache: LayerPool, rows: DecodeRows, kv_raw: torch.Tensor,
                       weight: torch.Tensor, eps: float, rope: Rope) -> bool:
    """The shared KV's RMSNorm + RoPE written straight into the slot's window ring (row i takes
    the values of its writer row, as decode_step.write_window). False where the ring's dtype
    differs from the KV's (the unfused write casts; the caller then takes that path)."""
    if cache.ring.dtype != kv_raw.dtype:
        return False
    w = cache.ring.shape[1]
    ring = cache.ring.view(-1, cache.ring.shape[-1])
    # a writer row has the same slot and position as the row it writes for: same cos/sin
    rope_norm(kv_raw, rope[0], rope[1], ring, norm=True, weight=weight, eps=eps,
              src_rows=rows.writer, dst_rows=rows.ring_rows(w))
    return True


def compress_decode_fused(comp: V4Compressor, kv: torch.Tensor, gate: torch.Tensor,
                          cp: CompressorPool, rows: DecodeRows, rotary: V4Rotary) -> None:
    """decode_step.compress_decode through ``kernels.compress_decode``; the entry rows are then
    written by the pool (FP8 or not). The unfused function where the buffers' dtype differs
    from the projections'."""
    if cp.buf_kv.dtype != kv.dtype:
        compress_decode(comp, kv, gate, cp, rows, rotary)
        return
    n, d = kv.shape[0], comp.dim
    out = kv.new_empty(n, d)
    dst = torch.empty(n, dtype=torch.long, device=kv.device)
    # a pool in the entries' dtype takes them from the kernel; an FP8 one is quantized after
    direct = cp.entries.scale is None and cp.entries.data.dtype == out.dtype
    compress_decode_kernel(
        kv, gate, rows.writer, rows.slots, rows.positions, rows.tables, cp.buf_kv, cp.buf_gate,
        comp.position_bias, comp.kv_norm.weight, comp.kv_norm.eps, rotary.inv_freq,
        float(rotary.scale), cp.block_size, ent=torch.empty_like(out), out=out, dst=dst,
        ov_kv=cp.ov_kv, ov_gate=cp.ov_gate,
        pool=cp.entries.data.view(-1, d) if direct else None)
    if not direct:
        cp.entries.write(dst, out)


def moe_fused(mlp: V4MoE, x: torch.Tensor, input_ids: torch.Tensor, ws: object | None,
              side: DecodeSide | None = None) -> torch.Tensor:
    """V4MoE.forward of a decode step with the routing and the shared expert's SwiGLU as one
    kernel each (``kernels.moe_decode``). The module's own forward where it is not the plain
    single-device MXFP4 layer (tensor-parallel ranks, bf16 experts). With a ``side`` lane the
    shared expert runs there, beside the routing and the routed experts, joined before the
    experts' combine adds into its output."""
    cfg = mlp.cfg
    if (mlp.reduce is not None or mlp.expert_offset or not mlp.add_shared
            or not isinstance(mlp.experts, Mxfp4Experts)
            or mlp.experts.shape[0] != cfg.n_routed_experts):
        return mlp(x, input_ids, ws)
    n, k = x.shape[0], cfg.num_experts_per_tok
    weights = torch.empty(n, k, dtype=torch.float32, device=x.device)
    experts = torch.empty(n, k, dtype=torch.long, device=x.device)
    route = dict(hash_table=mlp.gate.tid2eid, token_ids=input_ids) if mlp.is_hash else dict(
        bias=mlp.gate.e_score_correction_bias)
    se = mlp.shared_experts
    forked = side is not None and side.takes_shared_expert(se)
    if forked:
        assert side is not None
        # made here: the experts' call below takes it before the side has written it (their
        # combine, the first launch to read it, waits for the join)
        base = torch.empty_like(x)
        side.run(lambda: _shared_expert(se, x, base), se, keep=(x, base))
    gw = mlp.gate.weight
    # the model's split-K counters (bound with the workspace; quant_modules.bind_workspace)
    sem = getattr(se.down_proj, "semaphores", None)
    if (sem is not None and n <= FUSED_ROUTER_MAX_ROWS and sem.numel() >= n
            and gw.dtype == x.dtype and gw.stride(1) == 1 and x.stride(1) == 1):
        logits = torch.empty(n, gw.shape[0], dtype=x.dtype, device=x.device)
        moe_router(x, gw, k, cfg.scoring_func, cfg.routed_scaling_factor, weights=weights,
                   experts=experts, logits=logits, semaphores=sem, **route)
    else:
        moe_route(F.linear(x, gw), k, cfg.scoring_func, cfg.routed_scaling_factor,
                  weights=weights, experts=experts, **route)
    if not forked:
        base = _shared_expert(se, x)
        return mlp.experts.add_into(x, weights, experts, base, cfg.swiglu_limit, ws)
    assert side is not None
    out = mlp.experts.add_into(x, weights, experts, base, cfg.swiglu_limit, ws,
                               before_combine=side.lane.join)
    side.lane.join()  # (no-op after the combine's; with no tokens there was none)
    return out


def _shared_expert(se: torch.nn.Module, x: torch.Tensor, out: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """The shared expert of a decode step: gate-up (one GEMV when merged, layers/merged_groups.py),
    the clamped SwiGLU kernel, down (into ``out`` when given: an FP8 down projection)."""
    gate, up = se.gate_up(x)
    act = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    h = clamped_swiglu(gate, up, se.limit, act)
    return se.down_proj(h) if out is None else se.down_proj(h, out=out)


FUSED_INDEXER_TILE = 32768  # entries scored a launch by the fused indexer (fp32 scores a row)


def fused_indexer_keys(keys: PagedRows, dtype: torch.dtype) -> bool:
    """Whether :func:`indexer_topk_fused` scores these keys with its kernels: the queries'
    dtype, or FP8 with a scale a row (dequantised in the kernel); else PyTorch does."""
    if keys.scale is not None:
        return keys.data.dtype == torch.float8_e4m3fn
    return keys.data.dtype == dtype


def indexer_kv_end(rows: DecodeRows, rate: int) -> torch.Tensor:
    """[B] closed entries of each row's sequence at ``rate`` once this step's token is in
    (memoised for the step)."""
    return rows.memo(("kv_end", rate), lambda: (rows.positions + 1) // rate)


def indexer_topk_fused(q: torch.Tensor, weights: torch.Tensor, keys: PagedRows, rows: DecodeRows,
                       rate: int, block_size: int, topk: int) -> torch.Tensor:
    """decode_step.indexer_topk_decode as kernels, answering with pool rows: each tile of
    ``FUSED_INDEXER_TILE`` entries scored straight from the pool's rows
    (``kernels.indexer_decode``), merged into each row's running top-k on the device (the
    prefill indexer's merge, which reads only the row's closed entries; a tile past them costs
    two near-empty launches), and the picks written as the pool rows of the entries (the
    compressor's pool shares the indexer's addressing) -> [B, topk] int32, -1 for none: the
    sparse attention's indices as they are; FP8 keys are dequantised by the kernel, row by
    row. The PyTorch scoring and ``torch.topk`` merge where the kernels cannot read the keys."""
    per = block_size // rate
    if not fused_indexer_keys(keys, q.dtype):
        idx = indexer_topk_decode(q, weights, keys, rows, rate, block_size, topk)
        return torch.where(idx >= 0, rows.entry_rows(idx.clamp(min=0), per), -1).to(torch.int32)
    kv_end = indexer_kv_end(rows, rate)
    out = torch.empty(q.shape[0], topk, dtype=torch.int32, device=q.device)
    return indexer_decode_topk(q, weights, keys.data.view(-1, keys.dim), rows.tables, kv_end,
                               per, topk, FUSED_INDEXER_TILE, out,
                               key_scale=None if keys.scale is None else keys.scale.view(-1))
