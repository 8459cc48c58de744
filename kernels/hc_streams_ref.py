"""PyTorch reference (the specification) of ``kernels.hc_streams``: the two stream passes of
DeepSeek-V4's manifold-constrained hyper-connections (mHC), exactly as the model's eager path
computes them (transformers' formulation)."""

from __future__ import annotations

import torch


def hc_merge_ref(post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor,
                 streams: torch.Tensor) -> torch.Tensor:
    """New streams after a block: ``post * block_out + comb^T @ streams``.
    post: [N, m] fp32, comb: [N, m, m] fp32, block_out: [N, D], streams: [N, m, D] -> [N, m, D]
    in the streams' dtype (post and comb rounded to it first, as transformers does)."""
    dt = streams.dtype
    return (post.to(dt).unsqueeze(-1) * block_out.unsqueeze(-2)
            + torch.matmul(comb.to(dt).transpose(-1, -2), streams))


def hc_collapse_ref(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """The block input: ``sum_j pre[:, j] * streams[:, j]`` in fp32, cast to the streams' dtype.
    pre: [N, m] fp32, streams: [N, m, D] -> [N, D]."""
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
