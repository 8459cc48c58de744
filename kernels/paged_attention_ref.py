"""PyTorch references of dense paged attention (prefill chunks and decode): the specification.

``paged_attention_ref``: sequence b's queries are ``q[query_start_loc[b]:query_start_loc[b+1]]``,
the LAST q_len tokens of its context_lens[b]-token context, causal, GQA (query head h reads KV
head h // (Hq // Hkv)). Its KV token i lives at ``cache[block_tables[b, i // block_size],
i % block_size]``; an FP8 e4m3fn cache (``kernels.kv_quant``: scale 1) is read by upcasting
each stored value. fp32 arithmetic; it gathers each sequence's whole context, so it is for
tests and small shapes only. It must never change meaning: the Triton kernels follow it.
"""

from __future__ import annotations

import torch


def _gather(cache: torch.Tensor, block_table: torch.Tensor, n: int) -> torch.Tensor:
    """Tokens [0, n) of one sequence: [n, Hkv, D]."""
    block_size = cache.shape[1]
    pos = torch.arange(n, device=cache.device)
    if cache.element_size() == 1:  # FP8: gather the bytes (index kernels may lack FP8 types)
        raw = cache.view(torch.uint8)[block_table.long()[pos // block_size], pos % block_size]
        return raw.view(cache.dtype)
    return cache[block_table.long()[pos // block_size], pos % block_size]


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal GQA attention of each sequence's last q_len tokens over its paged context."""
    num_q_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    qsl, ctx = query_start_loc.tolist(), context_lens.tolist()
    for b in range(len(ctx)):
        q_b = q[qsl[b] : qsl[b + 1]].float()  # [L, Hq, D]
        q_len = q_b.shape[0]
        if q_len == 0:
            continue
        k = _gather(k_cache, block_tables[b], ctx[b]).float().repeat_interleave(group, dim=1)
        v = _gather(v_cache, block_tables[b], ctx[b]).float().repeat_interleave(group, dim=1)
        logits = torch.einsum("qhd,khd->hqk", q_b, k) * scale  # [Hq, L, ctx]
        q_pos = torch.arange(ctx[b] - q_len, ctx[b], device=q.device)
        k_pos = torch.arange(ctx[b], device=q.device)
        logits.masked_fill_(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        out[qsl[b] : qsl[b + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode: one query per sequence (its last token) against its whole context."""
    qsl = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_attention_ref(q, k_cache, v_cache, block_tables, qsl, context_lens, scale, out)
