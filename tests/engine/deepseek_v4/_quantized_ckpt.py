"""Tiny DeepSeek-V4 checkpoints quantized as V4-Flash ships them, for the quantized-weight tests.

``quantize_deepseek_layout`` turns the dense projections of a DeepSeek-layout state dict into
FP8 e4m3 with a 128 x 128 block grid (``ceil`` on each dimension, so awkward widths give partial
blocks; e8m0 or fp32 scales) and the routed experts into MXFP4 (packed e2m1 + e8m0 per 32);
``dequantized`` gives the exact values a quantized tensor stands for, which is what the
transformers reference model is loaded with."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from kernels.fp8_linear_ref import dequantize_fp8_block
from kernels.mxfp4_moe_ref import dequantize_mxfp4, quantize_mxfp4

_FP8 = re.compile(r"layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123])\.weight$")
_FP4 = re.compile(r"layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")
QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                "scale_fmt": "ue8m0", "activation_scheme": "dynamic", "expert_dtype": "fp4"}


def quantize_fp8_128(w: torch.Tensor, e8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    gn, gk = -(-n // 128), -(-k // 128)
    pad = torch.zeros(gn * 128, gk * 128)
    pad[:n, :k] = w.float()
    blocks = pad.view(gn, 128, gk, 128)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    if e8m0:
        scale = torch.ceil(torch.log2(scale)).exp2()
    q = (blocks / scale[:, None, :, None]).view_as(pad)[:n, :k].to(torch.float8_e4m3fn).contiguous()
    return q, (scale.to(torch.float8_e8m0fnu) if e8m0 else scale)


def quantize_deepseek_layout(sd: dict[str, torch.Tensor], e8m0: bool = True) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        stem = name[: -len("weight")]
        if _FP8.search(name):
            out[name], out[stem + "scale"] = quantize_fp8_128(t, e8m0)
        elif _FP4.search(name):
            packed, scale = quantize_mxfp4(t.float())
            out[name], out[stem + "scale"] = packed.view(torch.int8), scale.view(torch.float8_e8m0fnu)
        else:
            out[name] = t.contiguous()
    return out


def dequantized(qsd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fp32 values every quantized payload stands for; scales dropped."""
    out = {}
    for name, t in qsd.items():
        if name.endswith(".scale") and name[: -len("scale")] + "weight" in qsd:
            continue
        sname = name[: -len("weight")] + "scale"
        if t.dtype == torch.float8_e4m3fn:
            t = dequantize_fp8_block(t, qsd[sname])
        elif t.dtype == torch.int8 and sname in qsd:
            t = dequantize_mxfp4(t, qsd[sname])
        out[name] = t
    return out


def write_quantized(model: torch.nn.Module, folder: Path, e8m0: bool = True) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """save_pretrained (DeepSeek layout), then quantize the shards in place and declare it in
    config.json. Returns (config dict, the quantized state dict)."""
    model.save_pretrained(folder)
    qsd = quantize_deepseek_layout(load_file(folder / "model.safetensors"), e8m0)
    save_file(qsd, folder / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = QUANT_CONFIG
    (folder / "config.json").write_text(json.dumps(cfg))
    return cfg, qsd
