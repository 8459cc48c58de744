"""The private tiled pieces against plain dense references on awkward shapes: the indexer's
running top-k over KV tiles, and the query-tiled sparse attention (window + HCA / CSA)."""

from __future__ import annotations

import pytest
import torch

from engine.models.deepseek_v4.layers.indexer import indexer_topk_torch
from engine.models.deepseek_v4.layers.sparse_attention import v4_attention_torch


def _dense_index_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, kv_end: torch.Tensor) -> torch.Tensor:
    s = (torch.relu(torch.einsum("shd,td->sht", q.float(), k.float())) * w[:, :, None]).sum(1)
    return s.masked_fill(torch.arange(k.shape[0])[None, :] >= kv_end[:, None], float("-inf"))


@pytest.mark.parametrize(("q_tile", "kv_tile"), [(4, 7), (13, 64), (1, 1)])
def test_indexer_topk_tiles_equal_dense(q_tile: int, kv_tile: int) -> None:
    g = torch.Generator().manual_seed(0)
    s_len, h, d, t, topk = 13, 3, 5, 37, 6
    q, k = torch.randn(s_len, h, d, generator=g), torch.randn(t, d, generator=g)
    w = torch.randn(s_len, h, generator=g)
    kv_end = torch.randint(0, t + 1, (s_len,), generator=g)
    kv_end[0], kv_end[1] = 0, 3  # none visible; fewer than topk visible
    got = indexer_topk_torch(q, k, w, kv_end, topk, q_tile=q_tile, kv_tile=kv_tile)
    dense = _dense_index_scores(q, k, w, kv_end)
    vals, idx = dense.topk(topk, dim=1)
    want = torch.where(torch.isinf(vals), -1, idx)
    assert torch.equal(got, want)
    assert (got[0] == -1).all() and (got[1, 3:] == -1).all() and set(got[1, :3].tolist()) == {0, 1, 2}


def _dense_attention(q, window_kv, num_prev, window, sinks, scale, start, comp, rate, topk_idx):
    c = q.shape[0]
    qpos = start + torch.arange(c)
    kpos = start - num_prev + torch.arange(window_kv.shape[0])
    keys = [window_kv]
    mask = [(kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - window)]
    if comp is not None:
        e = torch.arange(comp.shape[0])
        vis = e[None, :] < ((qpos + 1) // rate)[:, None]
        if topk_idx is not None:
            sel = torch.zeros(c, comp.shape[0], dtype=torch.bool)
            for i in range(c):
                chosen = topk_idx[i][topk_idx[i] >= 0]
                sel[i, chosen] = True
            vis = vis & sel
        keys.append(comp)
        mask.append(vis)
    kk = torch.cat(keys)
    m = torch.cat(mask, dim=1)
    s = torch.einsum("chd,kd->chk", q, kk) * scale
    s = s.masked_fill(~m[:, None, :], float("-inf"))
    s = torch.cat([s, sinks[None, :, None].expand(c, -1, 1)], dim=-1)
    p = torch.softmax(s, dim=-1)[..., :-1]
    return torch.einsum("chk,kd->chd", p, kk)


@pytest.mark.parametrize("kind", ["sliding", "hca", "csa"])
@pytest.mark.parametrize(("start", "c", "q_tile"), [(0, 11, 4), (9, 5, 3), (23, 1, 64)])
def test_sparse_attention_equals_dense(kind: str, start: int, c: int, q_tile: int) -> None:
    g = torch.Generator().manual_seed(start + c)
    h, d, window, rate = 3, 6, 5, 4
    num_prev = min(start, window - 1)
    q = torch.randn(c, h, d, generator=g)
    wkv = torch.randn(num_prev + c, d, generator=g)
    sinks = torch.randn(h, generator=g)
    comp = topk = None
    if kind != "sliding":
        comp = torch.randn((start + c) // rate + 2, d, generator=g)  # two stale rows past the end
    if kind == "csa":
        assert comp is not None
        vis = (start + torch.arange(c) + 1) // rate
        topk = torch.full((c, 3), -1)
        for i in range(c):
            n = int(vis[i])
            chosen = torch.randperm(n, generator=g)[:3] if n else torch.empty(0, dtype=torch.long)
            topk[i, : chosen.numel()] = chosen
    got = v4_attention_torch(q, wkv, num_prev, window, sinks, d**-0.5, start, comp=comp,
                             comp_rate=rate, topk_idx=topk, q_tile=q_tile)
    want = _dense_attention(q, wkv, num_prev, window, sinks, d**-0.5, start, comp, rate, topk)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
