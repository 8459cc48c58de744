"""The transient peak of one DeepSeek-V4 step on the kernels path (CUDA: Triton attention,
indexer, mHC and fused MoE), tensor by tensor, for the memory planner's ``activations`` term.

Each part names the tensors that are alive together at one moment of the step, as the model's
code holds them (docs/memory.md gives the same formulas). ``sizing.py`` keeps the looser
part-by-part bound of the PyTorch path (CPU). Pure arithmetic on the config; never allocates.
Keep it in step with step/chunk_attention.py, step/decode_step.py, layers/mhc.py, layers/moe.py
and model.py: a tensor added to the step there is a term here, or the plan-tightness tests fail
(GPU: the allocator's reading; CPU: the same warm-up's tensors counted by
lab/bench/deepseek_v4/step_trace.py). Where a term counts more than the code holds
(docs/memory.md lists it: ~3% at a 4096-token chunk) that is the margin for the CUDA
allocator's rounding.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.models.deepseek_v4.config import CSA, SLIDING, DeepseekV4Config
from engine.models.deepseek_v4.memory.sizing import (
    chunk_rows_bytes,
    deepseek_v4_decode_scratch_bytes,
)


def deepseek_v4_kernels_step_bytes(
    cfg: DeepseekV4Config | Any, chunk_tokens: int, max_context: int, max_batch: int,
    dtype: torch.dtype = torch.bfloat16, kv_tokens: int | None = None, kv_fp8: bool = False,
    fused_decode: bool = True,
) -> dict[str, int]:
    """Bytes by moment of the step at ``chunk_tokens`` scheduled tokens (``n``, at least
    ``max_batch``) over ``S = min(max_batch, n)`` sequences of at most ``max_context`` tokens,
    whose compressed entries together are bounded by the pool (``kv_tokens``, when known: the
    scheduler's ``max_step_context``). ``fused_decode``: a mixed step's one-token rows take the
    fused decode loop's kernels (the default on this path)."""
    cfg = DeepseekV4Config.coerce(cfg)
    n = max(chunk_tokens, max_batch)
    seqs = min(max_batch, n)
    e, f = torch.empty((), dtype=dtype).element_size(), 4
    hid, hc, h, d, r = cfg.hidden_size, cfg.hc_mult, cfg.num_heads, cfg.head_dim, cfg.rope_head_dim
    tokens = seqs * max_context if kv_tokens is None else min(seqs * max_context, kv_tokens)
    rates = [cfg.rate(t) for t in cfg.layer_types if t != SLIDING]
    entries = tokens // min(rates) if rates else 0  # every sequence's entries of one layer
    # one sequence's (the indexer reads its keys sequence by sequence)
    seq_entries = min(max_context, tokens) // min(rates) if rates else 0

    def read_tmp(dim: int, rows: int) -> int:
        """Reading ``rows`` FP8 rows out of the blocks: the bytes, their fp32 widening, the
        scaled copy (the model-dtype result is made while the bytes and the scaled copy live:
        rows x (1 + 4 + 2) x dim, within this)."""
        return rows * (dim + 4 + 2 * dim * f) if kv_fp8 else 0

    out: dict[str, int] = {}
    # the embedding output, the streams, the block's collapsed input and its normed copy, the
    # previous attention and MoE outputs (the layer loop's variables hold them until they are
    # reassigned), mHC weights, both rope tables, the step's ids and positions: alive while a
    # block runs
    # and the chunks' addressing (chunk_rows.py): their entry rows of each rate, window and ring
    # rows, per-row bounds (int64 + int32 copies)
    out["resident"] = (n * hid * e * (5 + hc) + n * (hc + hc * hc) * f + 2 * n * r * e + 2 * n * 8
                       + chunk_rows_bytes(tokens, n, seqs, cfg.sliding_window, rates))
    # an mHC's mixing weights and gates next to the streams (kernels.hc_mixes reads the streams
    # in place: no fp32 copy of them)
    out["mhc_mix"] = n * hid * e * (2 + hc) + n * (2 * hc + hc * hc) * f * 3
    # the merge after a block: old and new streams, the block output, the collapsed input
    out["mhc_merge"] = n * hid * e * (3 + 2 * hc)
    # attention, above "resident": queries [n, H, D] (their norm and rope, the shared KV's and
    # the output's de-rotation run in place as rope_norm kernels: no fp32 temporaries)
    q = n * h * d * e
    csa = cfg.uses_csa
    hi, di, k = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
    rest = n * (cfg.q_lora_rank + d) * e  # low-rank query, shared K=V
    if rates:  # compressor projections (CSA: two series of width 2D)
        rest += 2 * n * (2 * d if csa else d) * e
    # CSA: indexer queries and weights, its compressor projections
    if csa:
        rest += n * hi * di * e + n * hi * f + 2 * n * 2 * di * e
    # CSA's top-k ids while the chunks attend: the step's int32 table of rebased picks and a
    # sequence's rebasing temporaries (8 B a pick at most; 16 counted throughout)
    topk = n * k * (4 + 4 + 8) if csa else 0
    # the chunks' window table (counted twice: the margin of docs/memory.md)
    window = 2 * (seqs * (cfg.sliding_window - 1) + n) * d * e
    # a compressor's chunk (the open window's rows ahead of it) at its layer type's width:
    # CSA n + 4 rows of 2D, HCA n + 128 rows of D
    compressor = max([(n + cfg.rate(t)) * (2 * d if t == CSA else d) * (5 * e + 3 * f)
                      for t in cfg.layer_types if t != SLIDING], default=0)
    o_proj = n * (cfg.o_groups * cfg.o_lora_rank + hid) * e
    # after the window table and the top-k table, one of: a compressor at work, a sequence's
    # indexer keys read out of the blocks (freed before the next sequence's), or the batched
    # attention's table of every sequence's entries (made by one read, alive while the chunks
    # attend)
    late = max(compressor,
               seq_entries * di * e + read_tmp(di, seq_entries) if csa else 0,
               max(entries * d * e, read_tmp(d, entries)))
    early = n * cfg.q_lora_rank * e  # the low-rank query, before the output exists
    # a mixed step's one-token sequences, attended as one decode step after the chunks (whose
    # windows and entries are gone by then): their rows of the projections (copies when they
    # sit between the chunks), their output rows, step/decode_ops.py's own scratch
    decode = (seqs * (q + rest) // n + seqs * h * d * e
              + deepseek_v4_decode_scratch_bytes(cfg, seqs, max_context, dtype, kernels=True,
                                                 kv_fp8=kv_fp8, fused=fused_decode))
    # the output projections come after the chunks' window table, entries and top-k are freed
    out["attention"] = q + max(early, q + rest + max(topk + window + late, decode, o_proj))
    inter, ne, kx = cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok
    # router scores (softplus, biased), routing ids/weights, the shared expert's gate/up and
    # their clamped SwiGLU temporaries, its output
    out["moe"] = 3 * n * ne * f + n * kx * 24 + 6 * n * inter * e + 2 * n * hid * e
    # the final collapse and RMSNorm (fp32 temporaries of [n, hidden])
    out["final_norm"] = n * hid * e * (2 + hc) + n * hid * (3 * f + e)
    return out


def deepseek_v4_kernels_peak_bytes(parts: dict[str, int]) -> int:
    """The step's transient peak: the largest of its moments (attention and MoE run on top of
    the resident tensors; the mHC passes and the final norm hold what they need themselves)."""
    return max(parts["resident"] + parts["attention"], parts["resident"] + parts["moe"],
               parts["mhc_mix"], parts["mhc_merge"], parts["final_norm"])
