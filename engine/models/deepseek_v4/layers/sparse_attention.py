"""Private PyTorch core of V4 attention for one sequence's chunk: sliding window plus either
all visible compressed entries (HCA) or the indexer's top-k entries (CSA), with per-head sinks.

Walks the queries in tiles so scratch is bounded by the tile and the planned maximum context,
never by a score matrix over (chunk x context). Stand-in for the kernels package's sparse
attention; it must stay a readable reference (no in-place tricks on its inputs).
"""

from __future__ import annotations

import torch

ATTN_Q_TILE = 64  # query rows per tile


def v4_attention_torch(
    q: torch.Tensor,
    window_kv: torch.Tensor,
    num_prev: int,
    window: int,
    sinks: torch.Tensor,
    scale: float,
    start_pos: int,
    comp: torch.Tensor | None = None,
    comp_rate: int = 0,
    topk_idx: torch.Tensor | None = None,
    *,
    q_tile: int = ATTN_Q_TILE,
) -> torch.Tensor:
    """q: [C, H, D] queries at positions ``start_pos + i``; window_kv: [num_prev + C, D] keys
    (=values) at positions ``start_pos - num_prev + j``; query i sees window keys
    ``(pos - window, pos]``. comp: [E, D] compressed entries of this sequence (entry w visible to
    a query at pos iff ``w < (pos + 1) // comp_rate``). topk_idx: [C, k] (-1 = none): attend only
    to those entries (CSA); None with comp given: attend to every visible entry (HCA).
    Returns [C, H, D] in q's dtype (softmax in fp32 with the sink as an extra logit)."""
    c, h, d = q.shape
    if comp is not None and comp.shape[0] == 0:  # no window closed yet: nothing to attend to
        comp = None
    out = torch.empty_like(q)
    dev = q.device
    for i0 in range(0, c, q_tile):
        i1 = min(i0 + q_tile, c)
        qt = q[i0:i1].float()  # [T, H, D]
        qi = torch.arange(i0, i1, device=dev)
        j0 = max(0, i0 + num_prev - window + 1)
        j1 = i1 + num_prev
        kw = window_kv[j0:j1].float()  # [Kw, D]
        s_win = torch.einsum("thd,kd->thk", qt, kw) * scale
        rel = torch.arange(j0, j1, device=dev)[None, :] - (qi[:, None] + num_prev)  # key - query
        win_mask = (rel > 0) | (rel <= -window)
        s_win = s_win.masked_fill(win_mask[:, None, :], float("-inf"))
        parts_s = [s_win]
        parts_v = [kw]
        s_comp = v_comp = None
        if comp is not None and topk_idx is not None:
            idx = topk_idx[i0:i1]  # [T, k]
            v_comp = comp[idx.clamp(min=0)].float()  # [T, k, D]
            s_comp = torch.einsum("thd,tkd->thk", qt, v_comp) * scale
            s_comp = s_comp.masked_fill((idx < 0)[:, None, :], float("-inf"))
        elif comp is not None:
            visible = (start_pos + i1) // comp_rate  # entries any query of the tile may see
            if visible > 0:
                v_all = comp[:visible].float()
                s_all = torch.einsum("thd,ed->the", qt, v_all) * scale
                lim = (start_pos + qi + 1) // comp_rate  # [T]
                e_idx = torch.arange(visible, device=dev)
                s_all = s_all.masked_fill((e_idx[None, :] >= lim[:, None])[:, None, :], float("-inf"))
                parts_s.append(s_all)
                parts_v.append(v_all)
        sink = sinks.float()[None, :, None].expand(i1 - i0, h, 1)
        logits = torch.cat([*parts_s, *([s_comp] if s_comp is not None else []), sink], dim=-1)
        probs = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)
        n_shared = sum(p.shape[-1] for p in parts_s)
        acc = torch.einsum("thk,kd->thd", probs[..., :n_shared], torch.cat(parts_v))
        if s_comp is not None:
            assert v_comp is not None
            k_len = s_comp.shape[-1]
            acc = acc + torch.einsum("thk,tkd->thd", probs[..., n_shared : n_shared + k_len], v_comp)
        out[i0:i1] = acc.to(q.dtype)
    return out
