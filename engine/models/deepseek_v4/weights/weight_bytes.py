"""Resident weight bytes of a DeepSeek-V4 model from its config alone (``bulkhead plan``: no
weights read), counted over the model built on the meta device. Never allocates.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.models.deepseek_v4.config import DeepseekV4Config
from engine.models.deepseek_v4.model import _FP32_FRAGMENTS, DeepseekV4Model
from engine.models.deepseek_v4.weights.quant_weights import FP8_LINEAR


def deepseek_v4_weight_bytes(
    cfg: DeepseekV4Config | Any, dtype: torch.dtype = torch.bfloat16, fp8_linears: bool = False,
    mxfp4_experts: bool = False, weight_format: str = "checkpoint",
) -> int:
    """Resident weight bytes from the config alone (``bulkhead plan``, no weights read): every
    tensor of the model at ``dtype`` (fp32 where the model keeps fp32: norms, mHC, sinks,
    biases), except, with ``weight_format="checkpoint"``, V4-Flash's FP8 projections (1 B a
    value + an fp32 scale per 128 x 128 block) and MXFP4 experts (0.5 B a value + 1 B per 32)."""
    cfg = DeepseekV4Config.coerce(cfg)
    with torch.device("meta"):
        model = DeepseekV4Model(cfg)
    elem = torch.empty((), dtype=dtype).element_size()
    keep = weight_format == "checkpoint"
    total = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        n = t.numel()
        if "rotary" in name:
            continue
        if keep and fp8_linears and FP8_LINEAR.search(name):
            rows, cols = t.shape
            total += n + 4 * -(-rows // 128) * -(-cols // 128)
        elif keep and mxfp4_experts and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            total += n // 2 + n // 32
        elif not t.is_floating_point():
            total += n * t.element_size()
        else:
            total += n * (4 if any(f in name for f in _FP32_FRAGMENTS) else elem)
    return total
