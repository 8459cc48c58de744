"""Rotary position embeddings: cos/sin tables computed once at start-up for every position up to
the planned longest context (so no step builds them), with HF's default, linear, llama3 and yarn
frequency rules."""

from __future__ import annotations

import math

import torch

from engine.model_config import RopeConfig


def inv_frequencies(rope: RopeConfig, rotary_dim: int, max_position_embeddings: int) -> tuple[
    torch.Tensor, float
]:
    """(inv_freq [rotary_dim // 2] fp32, attention_scaling) as transformers computes them."""
    base = rope.theta
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    scaling = 1.0
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        old_ctx = rope.original_max_position_embeddings or 8192
        low_wavelen = old_ctx / rope.low_freq_factor
        high_wavelen = old_ctx / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_ctx / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    elif rope.rope_type == "yarn":
        inv_freq, scaling = _yarn(rope, rotary_dim, max_position_embeddings)
    return inv_freq, scaling


def _yarn(rope: RopeConfig, dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    return yarn_frequencies(rope.theta, dim, rope.factor,
                            rope.original_max_position_embeddings or max_pos, rope.beta_fast,
                            rope.beta_slow, rope.mscale, rope.mscale_all_dim)


def yarn_frequencies(theta: float, dim: int, factor: float, original_max_positions: int,
                     beta_fast: float, beta_slow: float, mscale: float | None = None,
                     mscale_all_dim: float | None = None,
                     attention_factor: float | None = None) -> tuple[torch.Tensor, float]:
    """YaRN (inv_freq [dim // 2] fp32, cos/sin multiplier) as transformers computes them; shared
    by every family that uses it."""
    orig = original_max_positions

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)

    def correction_dim(num_rot: float) -> float:
        return (dim * math.log(orig / (num_rot * 2 * math.pi))) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    inv_extra = 1.0 / pos_freqs
    inv_inter = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extra_factor = 1 - ramp
    inv_freq = inv_inter * (1 - extra_factor) + inv_extra * extra_factor
    return inv_freq, float(attention_factor)


class RotaryTable:
    """cos/sin [max_positions, rotary_dim] in the compute dtype, built once."""

    def __init__(self, rope: RopeConfig, rotary_dim: int, max_positions: int,
                 max_position_embeddings: int, dtype: torch.dtype, device: torch.device) -> None:
        inv_freq, scaling = inv_frequencies(rope, rotary_dim, max_position_embeddings)
        t = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * scaling).to(dtype=dtype, device=device)
        self.sin = (emb.sin() * scaling).to(dtype=dtype, device=device)
        self.rotary_dim = rotary_dim

    @property
    def nbytes(self) -> int:
        return 2 * self.cos.numel() * self.cos.element_size()

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [N, heads, head_dim]; rotates the first rotary_dim dims (HF rotate_half layout)."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        d = self.rotary_dim
        rot = x[..., :d]
        half = d // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        out = rot * cos + rotated * sin
        if d == x.shape[-1]:
            return out
        return torch.cat((out, x[..., d:]), dim=-1)
