"""Synthetic DeepSeek-V4 weights in V4-Flash's shipped formats, made directly on the device: FP8
e4m3 with 128 x 128 block scales for the dense projections, MXFP4 (packed e2m1 + e8m0 per 32)
for the routed experts, bf16/fp32 for the rest, under the model's own names, so
``DeepseekV4Model.from_state_dict`` (the loader's path) adopts them without a copy.

Values are random with the spread of transformers' init (about 0.02 once dequantized); no
full-precision copy of a quantized tensor ever exists, so the full-depth model fits where its
bf16 form would not. Benchmark-only: the engine never imports it.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.models.deepseek_v4.config import DeepseekV4Config
from engine.models.deepseek_v4.model import DeepseekV4Model
from engine.models.deepseek_v4.quant_weights import FP8_LINEAR

QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                       "scale_fmt": "ue8m0", "activation_scheme": "dynamic", "expert_dtype": "fp4"}
_FP8_SPREAD = 64.0  # stored e4m3 values ~N(0, 64): well inside +-448, scale 0.02 / 64
_E8M0_FOR_0_02 = 120  # random e2m1 codes have std ~2.9; 2.9 * 2**(120 - 127) ~ 0.023


def quantized_hf_config(hf: dict[str, Any]) -> dict[str, Any]:
    """``hf`` (a config.json dict) declaring FP8 dense weights and FP4 experts."""
    return {**hf, "quantization_config": dict(QUANTIZATION_CONFIG)}


@torch.no_grad()
def synthetic_quantized_state_dict(cfg: DeepseekV4Config, device: torch.device | str,
                                   dtype: torch.dtype = torch.bfloat16,
                                   seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor of the model (transformers names, scales as ``X.scale`` /
    ``experts.*_scale``), quantized ones in their shipped formats, on ``device``."""
    with torch.device("meta"):
        meta = DeepseekV4Model(cfg)
    shapes = {n: (tuple(t.shape), t.dtype)
              for n, t in list(meta.named_parameters()) + list(meta.named_buffers()) if "rotary" not in n}
    gen = torch.Generator(device=device).manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, (shape, meta_dtype) in shapes.items():
        if FP8_LINEAR.search(name):
            n, k = shape
            out[name] = (torch.randn(shape, device=device, generator=gen, dtype=torch.bfloat16)
                         * _FP8_SPREAD).clamp(-448, 448).to(torch.float8_e4m3fn)
            out[name[: -len("weight")] + "scale"] = torch.full(
                (-(-n // 128), -(-k // 128)), 0.02 / _FP8_SPREAD, device=device)
        elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, rows, cols = shape
            out[name] = torch.randint(0, 256, (e, rows, cols // 2), device=device, generator=gen,
                                      dtype=torch.uint8)
            out[name + "_scale"] = torch.full((e, rows, cols // 32), _E8M0_FOR_0_02,
                                              dtype=torch.uint8, device=device)
        elif name.endswith("tid2eid"):
            r = torch.rand(cfg.vocab_size, cfg.n_routed_experts, generator=gen, device=device)
            out[name] = r.argsort(dim=1)[:, : cfg.num_experts_per_tok].contiguous()
        elif not meta_dtype.is_floating_point:
            out[name] = torch.zeros(shape, dtype=meta_dtype, device=device)
        elif "norm" in name or name.endswith("scale"):
            out[name] = torch.ones(shape, dtype=dtype, device=device)
        elif name.endswith(("base", "position_bias", "sinks", "e_score_correction_bias")):
            out[name] = torch.zeros(shape, dtype=dtype, device=device)
        else:
            out[name] = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)
    return out


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
