"""Worst-case per-step scratch of the DeepSeek-V4 family, for the memory planner.

Each entry is the peak of one part of a step at ``chunk_tokens`` scheduled tokens against a
context of ``max_context``. The mHC streams live through the whole step; the attention parts
(projections, compressor, indexer, sparse attention) are live together; the MoE and the final
norm each run alone. :func:`deepseek_v4_step_peak_bytes` composes them that way; the plain sum
is a looser bound. The indexer's scratch comes from the
kernels package's own size function. Never allocates; pure arithmetic on the config.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.models.deepseek_v4.config import CSA, DeepseekV4Config
from engine.models.deepseek_v4.layers.indexer import INDEXER_KV_TILE, INDEXER_Q_TILE
from engine.models.deepseek_v4.layers.sparse_attention import ATTN_Q_TILE
from engine.models.deepseek_v4.step.decode_ops import DECODE_INDEXER_TILE
from engine.models.deepseek_v4.step.fused_ops import FUSED_INDEXER_TILE


def deepseek_v4_step_scratch_bytes(
    cfg: DeepseekV4Config | Any, chunk_tokens: int, max_context: int, max_batch: int,
    dtype: torch.dtype = torch.bfloat16, backend: str = "kernels",
) -> dict[str, int]:
    """Bytes by role: ``mhc_streams``, ``attention_projections``, ``compressor``, ``indexer``,
    ``sparse_attention``, ``paged_gather``, ``moe``, ``final_norm``, ``decode_batched``,
    ``chunk_rows``. ``cfg``: a DeepseekV4Config or the engine's
    ModelConfig; ``backend`` is the resolved :class:`V4Backend` kind ("kernels" or "torch")."""
    cfg = DeepseekV4Config.coerce(cfg)
    n = max(chunk_tokens, max_batch)  # a decode step schedules up to max_batch tokens
    e, f = torch.empty((), dtype=dtype).element_size(), 4
    hid, hc = cfg.hidden_size, cfg.hc_mult
    h, d, r2 = cfg.num_heads, cfg.head_dim, cfg.rope_head_dim
    out: dict[str, int] = {}
    # streams + their next value + the merge temporaries, and the fp32 mixing input of an mHC
    # (flattened streams, normed copy, one elementwise temporary, the fp32 collapse product).
    out["mhc_streams"] = n * hc * hid * (4 * e + 4 * f) + n * hid * (2 * e + 2 * f)
    # q_b output, its fp32 norm temporaries and the normed copy; rope temporaries on the rope
    # slice; the attention output and its de-rotated copy; low-rank and grouped projections.
    q_elems = n * h * d
    rope_tmp = 6 * n * h * r2 * f
    out["attention_projections"] = (
        q_elems * (3 * e + 2 * f) + rope_tmp + n * (cfg.q_lora_rank + cfg.o_groups * cfg.o_lora_rank) * (e + f)
        + n * (d + hid) * (2 * e + f)
    )
    comp = 0
    idx = 0
    attn = 0
    rates = {cfg.rate(t) for t in cfg.layer_types if cfg.rate(t)}
    for rate in rates:
        widths = [2 * d if rate == cfg.csa_rate and cfg.uses_csa else d]
        if rate == cfg.csa_rate and cfg.uses_csa:
            widths.append(2 * cfg.index_head_dim)
        for w in widths:
            rows = n + rate
            # projections (+ carry), fp32 biased gates, the overlap layout (kv + fp32 gate),
            # softmax weights and the weighted product, per chunk.
            comp = max(comp, rows * w * (2 * e + 2 * f) + rows * w * (e + f) * 2 + rows * w * (e + f))
    if cfg.uses_csa:
        keys = max_context // cfg.csa_rate
        hi, di, k = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        q_and_w = n * hi * di * (2 * e + 6 * f) + n * hi * f * 2 + n * 8
        if backend == "kernels":
            from kernels.indexer_topk import indexer_topk_workspace_bytes

            sel = indexer_topk_workspace_bytes(n, hi, di, keys, k) + n * k * (4 + 4)
        else:
            rq, kt = min(n, INDEXER_Q_TILE), min(keys, INDEXER_KV_TILE)
            sel = rq * hi * di * f + 2 * rq * hi * kt * f + kt * di * f + 3 * rq * (k + kt) * (f + 8)
            sel += n * k * 8
        idx = q_and_w + sel
    # each sequence's window (previous window - 1 tokens + its rows), and their concatenation
    window_rows = max_batch * (cfg.sliding_window - 1) + n
    if backend == "kernels":
        attn = 2 * window_rows * d * e + n * 4 * 4 + 3 * n * cfg.index_topk * 8
    else:
        t = min(n, ATTN_Q_TILE)
        visible = max(
            [cfg.index_topk if lt == CSA else max_context // cfg.rate(lt) for lt in cfg.layer_types if cfg.rate(lt)],
            default=0,
        )
        kw = t + cfg.sliding_window
        per_key = t * h * f * 4  # logits, shifted logits, probabilities, one mask temporary
        gathered = t * cfg.index_topk * d * f if cfg.uses_csa else 0
        attn = window_rows * d * e + (kw + visible) * (per_key + d * f) + gathered + 3 * t * h * d * f
    out["compressor"] = comp
    out["indexer"] = idx
    # entries and indexer keys gathered out of the sequences' blocks: every sequence's entries
    # of the densest compressed layer (the batched kernels take them as one table, built from
    # per-sequence copies: x2) and one sequence's indexer keys; fp32 for FP8 dequantisation
    rates_used = [cfg.rate(t) for t in cfg.layer_types if cfg.rate(t)]
    gathered_entries = max_batch * (max_context // min(rates_used)) if rates_used else 0
    out["paged_gather"] = 2 * gathered_entries * d * (e + f)
    if cfg.uses_csa:
        out["paged_gather"] += (max_context // cfg.csa_rate) * cfg.index_head_dim * (e + f)
    out["sparse_attention"] = attn
    inter, kx, ne = cfg.moe_intermediate_size, cfg.num_experts_per_tok, cfg.n_routed_experts
    routed_rows = n * kx  # hash tables may repeat an expert for a token: bound by all picks
    out["moe"] = (
        n * ne * f * 4 + routed_rows * (8 * 4 + f)  # scores, routing, sort
        + routed_rows * (hid * e + 2 * inter * e + 4 * inter * e + 2 * hid * e)  # per-expert rows
        + n * hid * e * 2 + n * inter * e * 5  # output accumulator, shared expert
    )
    out["final_norm"] = n * hc * hid * f * 3 + n * hid * (e + 2 * f)
    out["decode_batched"] = deepseek_v4_decode_scratch_bytes(cfg, max_batch, max_context, dtype)
    out["chunk_rows"] = chunk_rows_bytes(max_batch * max_context, n, min(max_batch, n),
                                         cfg.sliding_window, rates_used)
    return out


def chunk_rows_bytes(tokens: int, rows: int, seqs: int, window: int, rates: list[int]) -> int:
    """The step's chunk addressing (chunk_rows.py), alive through the whole step: the entry
    rows of each rate of ``tokens`` context tokens, ring and window-table rows, and per-row
    bounds (int64, the attention's int32 copies). Small next to the entries it addresses."""
    entries = sum(tokens // r for r in set(rates))
    return 8 * entries + 8 * 6 * (seqs * window + rows) + rows * (8 * 2 + 4 * 2) * (1 + 3 * len(set(rates)))


def deepseek_v4_decode_scratch_bytes(cfg: DeepseekV4Config, max_batch: int, max_context: int,
                                     dtype: torch.dtype = torch.bfloat16, kernels: bool = False,
                                     kv_fp8: bool = False, fused: bool = False) -> int:
    """What step/decode_step.py adds to a one-token-per-sequence step of ``max_batch`` rows beyond
    the projections: one tile of the batched indexer (keys gathered and widened to fp32, the
    [B, Hi, tile] fp32 scores and their ReLU and weighted copies, the running top-k; or, in
    the fused loop, ``kernels.indexer_decode``'s scratch at its wider tile, whichever is more),
    the attended entries' ids, the compressor's window (+ overlap) per row and the attention's
    inputs: on the PyTorch path (CPU) the gathered window and entry rows (+ their dequantised
    rows for an FP8 pool, counted at the model dtype + fp32) and the [B, H, window + entries]
    fp32 logits x 4; with ``kernels`` (the sparse attention kernel reads the ring and the pool
    in place) only an FP8 pool's dequantised entry rows (``kv_fp8``) and the kernel's split-K
    partials (``decode_attention_splits``). ``fused`` (with ``kernels``: the fused decode
    loop, the default there) and a model-dtype pool: the compressors run as kernels (no
    gathered window) and the indexer only as kernels (no PyTorch tile); an FP8 pool keeps the
    compressors' PyTorch fallback counted, and the indexer at the larger of its PyTorch tile
    and the kernel's scratch (the kernel reads FP8 keys with their scales)."""
    from kernels.indexer_decode import indexer_decode_topk_workspace_bytes
    from kernels.sparse_attention import (
        decode_attention_splits,
        sparse_attention_workspace_bytes,
    )

    b, e, f = max_batch, torch.empty((), dtype=dtype).element_size(), 4
    d, h, w = cfg.head_dim, cfg.num_heads, cfg.sliding_window
    comp_k = max([cfg.index_topk if t == CSA else max_context // cfg.rate(t)
                  for t in cfg.layer_types if cfg.rate(t)], default=0)
    if kernels:
        total = b * comp_k * (8 * 3 + (d * (e + f) if kv_fp8 else 0))
    else:
        total = b * comp_k * (8 * 3 + d * (e + f)) + b * h * (w + comp_k) * f * 4 + b * w * d * e
    # gathered window rows x width: CSA 2r rows (overlap) of 2D, HCA r rows of D
    window = max([2 * cfg.rate(t) * 2 * d if t == CSA else cfg.rate(t) * d
                  for t in cfg.layer_types if cfg.rate(t)], default=0)
    lean = fused and kernels and not kv_fp8  # no PyTorch fallback can run
    if not lean:
        total += b * window * (e + f) * 4
    if kernels and b:  # the sparse attention's split partials, at the batch size splitting most
        total += max(sparse_attention_workspace_bytes(r, h, d, decode_attention_splits(r, h, w + comp_k))
                     for r in range(1, b + 1))
    if cfg.uses_csa:
        entries = max(1, max_context // cfg.csa_rate)
        t = min(DECODE_INDEXER_TILE, entries)
        hi, di, k = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        torch_path = (b * t * (di * (e + f) + 8 * 2) + 3 * b * hi * t * f + 2 * b * t * f
                      + 2 * b * (k + t) * (f + 8) + b * k * (f + 8) + b * hi * di * f)
        # (the fused loop's kernels: their scratch at its own tile, and the picks as int32 rows)
        fused_path = (indexer_decode_topk_workspace_bytes(b, k, min(FUSED_INDEXER_TILE, entries))
                      + b * k * 4)
        total += fused_path if lean else max(torch_path, fused_path) if kernels else torch_path
    return total


_ATTENTION_PARTS = ("attention_projections", "compressor", "indexer", "sparse_attention",
                    "paged_gather")


def deepseek_v4_step_peak_bytes(scratch: dict[str, int]) -> int:
    """Transient peak of one step from :func:`deepseek_v4_step_scratch_bytes`'s parts:
    streams + max(attention parts together, MoE, final norm)."""
    attention = sum(scratch[k] for k in _ATTENTION_PARTS)
    # a decode step runs step/decode_step.py instead of the chunk path's gathers and indexer
    attention = max(attention, scratch["attention_projections"] + scratch.get("decode_batched", 0))
    return (scratch["mhc_streams"] + scratch.get("chunk_rows", 0)
            + max(attention, scratch["moe"], scratch["final_norm"]))


def fp8_act_quant_bytes(cfg: DeepseekV4Config | Any, tokens: int) -> int:
    """The largest activation-quantization scratch of V4's FP8 linears at ``tokens`` rows (the
    w8a8 prefill path, ``kernels.fp8_w8a8``): ``tokens x K x (1 + 4 / 128)`` B for the widest
    input K, which is the output projection's ``o_groups x o_lora_rank`` in V4-Flash (8,192);
    zero below the path's row threshold."""
    from kernels.fp8_w8a8 import W8A8_MIN_ROWS, fp8_w8a8_scratch_bytes

    cfg = DeepseekV4Config.coerce(cfg)
    if tokens < W8A8_MIN_ROWS:
        return 0
    h, d, hid = cfg.num_heads, cfg.head_dim, cfg.hidden_size
    inputs = [(hid, 1), (cfg.q_lora_rank, 1), (cfg.moe_intermediate_size, 1),
              (h * d // cfg.o_groups, cfg.o_groups), (cfg.o_groups * cfg.o_lora_rank, 1)]
    return max(fp8_w8a8_scratch_bytes(tokens, k, g) for k, g in inputs)


DECODE_ROWS = 32  # the most rows a decode GEMV form takes (kernels.fp8_linear: M <= 32)


def fp8_gemv_split_bytes(cfg: DeepseekV4Config | Any, tokens: int) -> int:
    """The largest split-K scratch of V4's FP8 linears at up to ``tokens`` rows (the decode
    GEMV's fp32 partials, ``kernels.fp8_linear.fp8_linear_scratch_bytes``, taken and released
    inside each projection): zero while the default decode variant does not split K."""
    from kernels.fp8_linear import fp8_linear_scratch_bytes

    cfg = DeepseekV4Config.coerce(cfg)
    h, d, hid, ql = cfg.num_heads, cfg.head_dim, cfg.hidden_size, cfg.q_lora_rank
    inter, og, ol = cfg.moe_intermediate_size, cfg.o_groups, cfg.o_lora_rank
    # (outputs over all groups, inputs of one group) of each FP8 projection, and of the two
    # merged ones (layers/merged_groups.py: q_a + kv, the shared expert's gate + up), which the
    # loader forms wherever the scale grids allow (the unmerged shapes stay: the fallback)
    shapes = [(ql, hid), (h * d, ql), (d, hid), (og * ol, h * d // og), (hid, og * ol),
              (inter, hid), (hid, inter), (ql + d, hid), (2 * inter, hid)]
    if cfg.uses_csa:
        shapes.append((cfg.index_n_heads * cfg.index_head_dim, ql))
    return max(fp8_linear_scratch_bytes(m, n, k) for m in range(1, min(tokens, DECODE_ROWS) + 1)
               for n, k in shapes) if tokens > 0 else 0


def deepseek_v4_decode_peak_bytes(scratch: dict[str, int]) -> int:
    """Transient peak of a step that is all decodes (what a captured decode graph runs): the
    same composition as :func:`deepseek_v4_step_peak_bytes` with step/decode_step.py's attention
    only. The chunk path's gathers are sized by every sequence's whole context and never run
    inside a graph, so counting them in the graph's pool reserved gigabytes it never touches."""
    attention = scratch["attention_projections"] + scratch.get("decode_batched", 0)
    return scratch["mhc_streams"] + max(attention, scratch["moe"], scratch["final_norm"])


def deepseek_v4_workspace_bytes(
    cfg: DeepseekV4Config | Any, chunk_tokens: int, max_context: int,
    mxfp4_experts: bool = False, dtype: torch.dtype = torch.bfloat16, indexer: bool = True,
    fp8_linears: bool = False,
) -> int:
    """Bytes the family takes from the engine's Workspace in one step (kernels backend): the
    larger of the indexer's scratch with its two [rows, topk] outputs and (``mxfp4_experts``)
    the fused MoE's scratch, plus alignment slack: each is taken in its own scope, the indexer
    inside attention and the MoE after it, so they never coexist. The rest of a step's
    transient memory is the ``deepseek_v4_step_scratch_bytes`` activations. Frames are per
    sequence, so the indexer's part does not grow with the number of sequences in a step.
    ``indexer=False``: the indexer runs in PyTorch and takes nothing from the Workspace.
    ``fp8_linears``: the FP8 projections' activation quantization (:func:`fp8_act_quant_bytes`)
    and their decode split-K partials (:func:`fp8_gemv_split_bytes`) are more such frames,
    taken and released inside each projection. The experts' frame is the largest at any step
    size up to ``chunk_tokens`` (a decode step's split-K partials may outweigh a larger step's
    unsplit scratch: ``moe_experts_max_workspace_bytes``). The prefill FP8 forms
    are opt-in (``quant_modules.set_prefill_fp8``), so their frames are counted whether or not
    they run, which costs nothing at V4-Flash's shape (the weight-only experts' frame or the
    indexer's is larger). With FP8 linears a fused decode step's side lane holds one more
    split-K frame for the whole step, under the others: added to the MoE's."""
    cfg = DeepseekV4Config.coerce(cfg)
    moe = 0
    split = fp8_gemv_split_bytes(cfg, chunk_tokens) if fp8_linears else 0
    if fp8_linears:
        moe = max(fp8_act_quant_bytes(cfg, chunk_tokens), split) + 256
    if mxfp4_experts:
        from kernels.mxfp4_moe import moe_experts_max_workspace_bytes

        # either form of the experts may run (the FP8 one is opt-in): the larger of the two
        moe = max(moe, *(moe_experts_max_workspace_bytes(
            chunk_tokens, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
            cfg.n_routed_experts, dtype, fp8) + 256 for fp8 in (False, True)))
    if split:
        # a fused decode step's side lane (step/decode_step.py) holds a split-K frame of its own for
        # the whole step, under every frame of the main lane
        moe += split + 256
    if not cfg.uses_csa or not indexer:
        return moe
    from kernels.indexer_topk import indexer_topk_workspace_bytes

    need = indexer_topk_workspace_bytes(
        chunk_tokens, cfg.index_n_heads, cfg.index_head_dim, max_context // cfg.csa_rate, cfg.index_topk
    )
    return max(need + 2 * chunk_tokens * cfg.index_topk * 4 + 3 * 256, moe)
