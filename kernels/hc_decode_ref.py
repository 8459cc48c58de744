"""PyTorch reference (the specification) of ``kernels.hc_decode``: the mHC work between two
blocks of a DeepSeek-V4 decode step, fused. Optionally the merge after the previous block, then
the next block's pre-mix: mixing weights from the (new) streams, Sinkhorn, collapse, and the
block's input RMSNorm. Composed from the model's own formulation (transformers', with the
norm's scale applied after the projection, as the model's ``kernels`` mHC path does)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.hc_streams_ref import hc_collapse_ref, hc_merge_ref
from kernels.sinkhorn_ref import sinkhorn_ref


def hc_mixes_ref(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """``linear(flat streams, fn) * rsqrt(mean(flat^2) + eps)`` in fp32: [N, rows]."""
    xf = streams.flatten(1).float()
    inv = torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)
    return F.linear(xf, fn.float()) * inv


def hc_decode_ref(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
    norm_weight: torch.Tensor, iters: int, hc_eps: float, norm_eps: float,
    merge: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, head: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """streams [N, m, D]; fn [(2+m)*m, m*D] fp32 (``head``: [m, m*D]), base, scale fp32 (the
    hyper-connection's), norm_weight [D] fp32 (the block's input RMSNorm). ``merge``: (post
    [N, m], comb [N, m, m], block_out [N, D]) of the previous block, merged into ``streams``
    first. Returns (streams after the merge, post [N, m] fp32, comb [N, m, m] fp32, normed block
    input [N, D] in the streams' dtype); ``head``: the final collapse (post and comb None)."""
    m = streams.shape[1]
    if merge is not None:
        streams = hc_merge_ref(merge[0], merge[1], merge[2], streams)
    mixes = hc_mixes_ref(streams, fn, norm_eps)
    if head:
        pre = torch.sigmoid(mixes * scale.float() + base.float()) + hc_eps
        post = comb = None
    else:
        pre_w, post_w, comb_w = mixes.split([m, m, m * m], dim=-1)
        pre_b, post_b, comb_b = base.split([m, m, m * m])
        s_pre, s_post, s_comb = scale.unbind(0)
        pre = torch.sigmoid(pre_w * s_pre + pre_b) + hc_eps
        post = 2 * torch.sigmoid(post_w * s_post + post_b)
        comb = sinkhorn_ref(comb_w.view(-1, m, m) * s_comb + comb_b.view(m, m), iters, hc_eps)
    x = hc_collapse_ref(pre, streams)
    x = F.rms_norm(x.float(), (x.shape[-1],), norm_weight, norm_eps).to(x.dtype)
    return streams, post, comb, x
