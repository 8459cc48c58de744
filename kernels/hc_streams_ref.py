"""PyTorch reference (the specification) of ``kernels.hc_streams``: the stream passes of
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


def hc_mixes_ref(streams: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """The mixing weights of a block: ``linear(rms_norm(flattened streams in fp32), fn)``
    (an unweighted RMSNorm). streams: [N, m, D], fn: [rows, m * D] fp32 -> [N, rows] fp32."""
    x = streams.flatten(1).float()
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return torch.nn.functional.linear(x, fn.float())
