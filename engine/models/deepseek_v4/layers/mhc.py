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
from engine.models.deepseek_v4.layers.norms import unweighted_rms_norm
from kernels.hc_streams import hc_collapse, hc_merge, hc_mixes
from kernels.hc_streams_ref import hc_collapse_ref, hc_merge_ref
from kernels.sinkhorn import sinkhorn
from kernels.sinkhorn_ref import sinkhorn_ref


def _mixes(streams: torch.Tensor, fn: torch.Tensor, eps: float, kernels: bool) -> torch.Tensor:
    """``linear(rms_norm(flattened streams in fp32), fn)`` [N, rows] fp32. ``kernels``: one
    pass over the streams (``kernels.hc_mixes``: the product and the sum of squares from the
    same tiles, the norm's scale applied to the product), where PyTorch writes an fp32 copy of
    the streams (256 MiB at a 4096-token chunk) and reads it twice more."""
    if not kernels:
        return F.linear(unweighted_rms_norm(streams.flatten(1).float(), eps), fn.float())
    out = torch.empty(streams.shape[0], fn.shape[0], dtype=torch.float32, device=streams.device)
    return hc_mixes(streams, fn, eps, out)


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
        ``kernels``: Sinkhorn and the collapse as Triton kernels (the Sinkhorn loop is ~6 x iters
        small kernels; the collapse in PyTorch materialises an fp32 [N, hc, hidden] product)."""
        m = self.hc
        mixes = _mixes(streams, self.fn, self.norm_eps, kernels)
        pre_w, post_w, comb_w = mixes.split([m, m, m * m], dim=-1)
        pre_b, post_b, comb_b = self.base.split([m, m, m * m])
        s_pre, s_post, s_comb = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * s_pre + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * s_post + post_b)
        logits = comb_w.view(-1, m, m) * s_comb + comb_b.view(m, m)
        comb = (sinkhorn(logits, self.iters, self.eps, torch.empty_like(logits)) if kernels
                else sinkhorn_ref(logits, self.iters, self.eps))
        return post, comb, collapse(pre, streams, kernels)


def collapse(pre: torch.Tensor, streams: torch.Tensor, kernels: bool) -> torch.Tensor:
    """``sum_j pre_j * stream_j`` [N, hidden] in the streams' dtype."""
    if not kernels:
        return hc_collapse_ref(pre, streams)
    out = torch.empty(streams.shape[0], streams.shape[2], dtype=streams.dtype, device=streams.device)
    return hc_collapse(pre.contiguous(), streams, out)


def merge(post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, streams: torch.Tensor,
          kernels: bool) -> torch.Tensor:
    """New streams ``post * out + comb^T @ streams``: [N, hc, hidden] in the streams' dtype
    (``kernels``: one pass over the streams instead of a batched 4 x 4 matmul per token)."""
    if not kernels:
        return hc_merge_ref(post, comb, block_out, streams)
    return hc_merge(post.contiguous(), comb, block_out, streams, torch.empty_like(streams))


class HyperHead(nn.Module):
    """Final collapse of the streams before the model norm."""

    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        m = cfg.hc_mult
        self.eps, self.norm_eps = cfg.hc_eps, cfg.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.empty(m, m * cfg.hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(m, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor, kernels: bool = False) -> torch.Tensor:
        mixes = _mixes(streams, self.hc_fn, self.norm_eps, kernels)
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return collapse(pre, streams, kernels)
