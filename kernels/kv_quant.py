"""How a dense paged KV cache stores K and V: in the model dtype, or in FP8 e4m3 (``kv_dtype=fp8``).

The FP8 format is ``torch.float8_e4m3fn`` with one implicit scale of 1.0 for the whole cache
(vLLM's uncalibrated default): a value is clamped to +-448 (the largest finite e4m3fn) and cast
with round-to-nearest-even; a reader upcasts it as is. Why not a per-token-per-head scale:
- K after RoPE and V of the dense families we serve (Llama, Qwen2, Qwen3) sit far inside +-448,
  so nothing clamps; e4m3 keeps 3 mantissa bits, a relative error of at most 2^-4 for
  |x| >= 2^-6 and an absolute one of at most 2^-10 below (subnormals), which the attention
  softmax and the V average largely absorb (tests/engine/test_kv_fp8.py states and checks the
  engine-level tolerance).
- No scale arrays: a block is exactly half the bf16 bytes, export/import stay raw bytes, and
  every reader needs one cast, no extra loads.
The clamp is not optional: torch's cast to e4m3fn on CUDA turns out-of-range values into NaN
(e4m3fn has no infinity), and one NaN key poisons every later query of its sequence.
Changing the scheme changes what the stored bytes mean: ``KV_FP8_SCHEME`` goes into the layout
fingerprint so engines of different schemes never exchange blocks.
This module only converts; it must never allocate beyond the converted tensor it returns.
"""

from __future__ import annotations

import torch

KV_FP8_DTYPE = torch.float8_e4m3fn
KV_FP8_MAX = float(torch.finfo(KV_FP8_DTYPE).max)  # 448
KV_FP8_SCHEME = "e4m3fn-scale1"


def is_fp8_cache(cache: torch.Tensor) -> bool:
    """Whether ``cache`` stores FP8 (every reader upcasts, every writer clamps first)."""
    return cache.dtype == KV_FP8_DTYPE


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the cache stores it: unchanged in the model dtype, clamped to +-448 and cast
    (round to nearest even) for FP8. The result is bit-identical to the fused Triton writer's."""
    if cache_dtype != KV_FP8_DTYPE:
        return x.to(cache_dtype)
    return x.clamp(-KV_FP8_MAX, KV_FP8_MAX).to(cache_dtype)
