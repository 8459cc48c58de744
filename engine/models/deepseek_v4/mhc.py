"""Manifold-constrained hyper-connections (mHC): ``hc_mult`` residual streams per token, mixed
around each block by weights a small projection computes from the streams themselves, the
stream-mixing matrix projected towards doubly-stochastic by Sinkhorn iterations.

Parameter names follow transformers (``fn``, ``base``, ``scale``; head: ``hc_fn`` ...).
All weights stay fp32. Pure per-token functions: nothing here depends on other tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.deepseek_v4.config import DeepseekV4Config
from engine.models.deepseek_v4.norms import unweighted_rms_norm
from kernels.sinkhorn import sinkhorn
from kernels.sinkhorn_ref import sinkhorn_ref


class HyperConnection(nn.Module):
    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        m = cfg.hc_mult
        self.hc, self.iters, self.eps, self.norm_eps = m, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
        self.fn = nn.Parameter(torch.empty((2 + m) * m, m * cfg.hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros((2 + m) * m, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def forward(self, streams: torch.Tensor, kernels: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams: [N, hc, hidden] -> post [N, hc] fp32, comb [N, hc, hc] fp32, collapsed [N, hidden].
        ``kernels``: Sinkhorn as one Triton kernel (the loop is ~6 x iters small kernels)."""
        m = self.hc
        mixes = F.linear(unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps), self.fn.float())
        pre_w, post_w, comb_w = mixes.split([m, m, m * m], dim=-1)
        pre_b, post_b, comb_b = self.base.split([m, m, m * m])
        s_pre, s_post, s_comb = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * s_pre + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * s_post + post_b)
        logits = comb_w.view(-1, m, m) * s_comb + comb_b.view(m, m)
        comb = (sinkhorn(logits, self.iters, self.eps, torch.empty_like(logits)) if kernels
                else sinkhorn_ref(logits, self.iters, self.eps))
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


def hc_merge(post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """New streams ``post * out + comb^T @ streams``: [N, hc, hidden] in the streams' dtype."""
    dt = streams.dtype
    return post.to(dt).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(comb.to(dt).transpose(-1, -2), streams)


class HyperHead(nn.Module):
    """Final collapse of the streams before the model norm."""

    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        m = cfg.hc_mult
        self.eps, self.norm_eps = cfg.hc_eps, cfg.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.empty(m, m * cfg.hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(m, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps), self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
