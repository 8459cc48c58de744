"""DeepSeek-V4's interleaved partial RoPE: consecutive channel pairs of the *trailing*
``rope_head_dim`` channels of a head rotate; the leading channels pass through.

Never allocates tables that scale with context: cos/sin are computed for the positions at hand.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.deepseek_v4.config import DeepseekV4Config, RopeParams
from kernels.rope_norm import rope_norm

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin) [N, R/2] at the rows' positions


class V4Rotary(nn.Module):
    """cos/sin ``[N, rope_dim // 2]`` for one rope flavour (main or compress)."""

    def __init__(self, params: RopeParams, rope_dim: int, max_positions: int) -> None:
        super().__init__()
        inv_freq, scale = params.inv_freq_and_scale(rope_dim, max_positions)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scale = scale

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [N] int -> cos, sin: [N, rope_dim // 2] in ``dtype`` (as transformers casts)
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        return (freqs.cos() * self.scale).to(dtype), (freqs.sin() * self.scale).to(dtype)


def rotaries(cfg: DeepseekV4Config) -> tuple[V4Rotary, V4Rotary]:
    """(main, compress) rotaries of a config."""
    mp = cfg.max_position_embeddings
    return (
        V4Rotary(cfg.main_rope, cfg.rope_head_dim, mp),
        V4Rotary(cfg.compress_rope, cfg.rope_head_dim, mp),
    )


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, ..., D]; cos/sin: [N, R/2] (broadcast over the middle dims). Rotates the last R
    channels pairwise in fp32 and returns a new tensor in x's dtype."""
    half = cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    # (x1 + i x2)(cos + i sin) = (x1 cos - x2 sin) + i (x2 cos + x1 sin): the pairwise rotation
    # as one complex product (a handful of kernels instead of a dozen; this runs ~6 times a layer)
    freqs = torch.complex(cos.float(), sin.float()).reshape(shape)
    pairs = torch.view_as_complex(x[..., -2 * half :].float().unflatten(-1, (half, 2)))
    rotated = torch.view_as_real(pairs * freqs).flatten(-2).to(x.dtype)
    return torch.cat([x[..., : -2 * half], rotated], dim=-1)


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rope` written into ``x`` (same values): only the rope slice is rewritten,
    where the copying form copies all of a [tokens, heads, 512] query tensor to change its last
    64 channels. For tensors the caller owns (fresh projections, attention outputs)."""
    half = cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c = cos.float().reshape(shape)
    s = sin.float().reshape(shape)
    rope = x[..., -2 * half :]
    x1, x2 = rope[..., 0::2].float(), rope[..., 1::2].float()
    rope.copy_(torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2))
    return x


def rotate_(t: torch.Tensor, rope: Rope, norm: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """(Unweighted norm and) RoPE of [N, H, D] rows in place, one launch
    (``kernels.rope_norm``): the kernels' form of :func:`apply_rope_`."""
    return rope_norm(t, rope[0], rope[1], t, norm=norm, eps=eps)


def rope_norm_(t: torch.Tensor, rope: Rope, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Weighted RMSNorm + RoPE of [N, D] rows in place, one launch (the shared KV)."""
    return rope_norm(t, rope[0], rope[1], t, norm=True, weight=weight, eps=eps)
