"""Synthetic DeepSeek-V4 weights in V4-Flash's shipped formats, made directly on the device: FP8
e4m3 with 128 x 128 block scales for the dense projections, MXFP4 (packed e2m1 + e8m0 per 32)
for the routed experts, bf16/fp32 for the rest. The tensors are those of
:func:`engine.models.deepseek_v4.weights.checkpoint_specs.checkpoint_specs`, the list the on-disk writer (:mod:`.write_checkpoint`)
walks too, renamed and merged by the loader's own :func:`to_hf_names`, so
``DeepseekV4Model.from_state_dict`` (the loader's path) adopts them without a copy.

Values are random with the spread of transformers' init (about 0.02 once dequantized); no
full-precision copy of a quantized tensor ever exists, so the full-depth model fits where its
bf16 form would not. Benchmark-only: the engine never imports it.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.models.deepseek_v4.config import DeepseekV4Config
from engine.models.deepseek_v4.weights.checkpoint_layout import to_hf_names
from engine.models.deepseek_v4.weights.checkpoint_specs import checkpoint_specs, make_tensor

QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                       "scale_fmt": "ue8m0", "activation_scheme": "dynamic", "expert_dtype": "fp4"}


def quantized_hf_config(hf: dict[str, Any]) -> dict[str, Any]:
    """``hf`` (a config.json dict) declaring FP8 dense weights and FP4 experts."""
    return {**hf, "quantization_config": dict(QUANTIZATION_CONFIG)}


@torch.no_grad()
def synthetic_quantized_state_dict(cfg: DeepseekV4Config, device: torch.device | str,
                                   dtype: torch.dtype = torch.bfloat16,
                                   seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor of the model (transformers names, scales as ``X.scale`` /
    ``experts.*_scale``), quantized ones in their shipped formats, the bf16 ones in ``dtype``,
    on ``device``. A layer's experts exist twice only while that layer's are stacked."""
    gen = torch.Generator(device=device).manual_seed(seed)
    sd = {s.name: make_tensor(s, cfg, gen, device, float_dtype=dtype) for s in checkpoint_specs(cfg)}
    return to_hf_names(sd, dtype, keep_quantized=True, consume=True)


def reblock_fp8_scales(sd: dict[str, torch.Tensor], block: int) -> dict[str, torch.Tensor]:
    """``sd`` (transformers names) with every FP8 linear's 128 x 128 scale grid re-expressed on
    ``block`` x ``block`` blocks (block divides 128; each small block keeps its 128-block's
    scale, so the weights stand for the same values). A toy model's widths are then whole
    blocks, as V4-Flash's are of 128, so the loader merges the projections it merges at
    V4-Flash's shapes (layers/merged_groups.py). In place; returns ``sd``."""
    assert 128 % block == 0, block
    for name in [k for k in sd if k.endswith(".scale")]:
        w = sd.get(name[: -len("scale")] + "weight")
        if w is None or w.dtype != torch.float8_e4m3fn:
            continue
        n, k = w.shape
        rows = torch.arange(-(-n // block), device=w.device) * block // 128
        cols = torch.arange(-(-k // block), device=w.device) * block // 128
        sd[name] = sd[name][rows][:, cols].contiguous()
    return sd


def active_weight_bytes(model: torch.nn.Module, cfg: DeepseekV4Config, batch: int) -> int:
    """Weight bytes one decode step of ``batch`` tokens must read at least once: everything but
    the routed experts and the embedding table (one row a token), plus the routed experts the
    step is expected to touch: per layer ``E * (1 - (1 - k/E) ** batch)`` of them (uniform
    routing)."""
    per_expert = 0
    rest = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        nbytes = t.numel() * t.element_size()
        if "rotary" in name:
            continue
        if ".mlp.experts." in name:
            per_expert += nbytes
        elif name.endswith("embed_tokens.weight"):
            rest += batch * t.shape[1] * t.element_size()
        else:
            rest += nbytes
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    touched = e * (1 - (1 - k / e) ** batch)
    return int(rest + per_expert / e * touched)  # per_expert summed all layers' experts
