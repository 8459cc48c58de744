"""PyTorch references (the specification) of ``kernels.fused``: residual add + RMSNorm, rotary
embedding of q and k with the paged KV write, and SiLU-and-multiply.

Each reference rounds exactly where the unfused PyTorch code of the dense families rounds (every
elementwise op returns the input dtype), so the fused kernels can be held to the same numbers.
"""

from __future__ import annotations

import torch

from kernels.kv_quant import quantize_kv


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [N, C]; weight: [C]. -> (normed [N, C], new residual [N, C] = x + residual,
    or x when residual is None). RMSNorm as transformers: in fp32, cast back, then scale."""
    s = x if residual is None else residual + x
    sf = s.float()
    sf = sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * sf.to(s.dtype), s


def rope_and_cache_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """q: [N, Hq, D], k/v: [N, Hkv, D]; cos/sin: [P, D] (HF rotate_half layout, cos[i] for both
    halves); slot_mapping: [N] flat slot of each token; k_cache/v_cache: [num_blocks, block_size,
    Hkv, D] (q's dtype, or FP8: ``quantize_kv``). Writes rotated k and v into the caches at the
    slots; returns rotated q [N, Hq, D]."""

    def rotate(x: torch.Tensor) -> torch.Tensor:
        c = cos[positions].unsqueeze(1)
        s = sin[positions].unsqueeze(1)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * c + rotated * s

    for cache, x in ((k_cache, rotate(k)), (v_cache, v)):
        rows = quantize_kv(x, cache.dtype)
        if cache.element_size() == 1:  # CPU index_copy_ has no FP8 kernel: move the bytes
            cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping.long(), rows)
    return rotate(q)


def silu_and_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up: [N, I] -> silu(gate) * up [N, I]."""
    return torch.nn.functional.silu(gate) * up
