"""What DeepSeek-V4's quantized payloads are and how the model keeps them.

Two forms arrive from a checkpoint (after :mod:`.checkpoint_layout` renamed them): FP8 e4m3 linears with a
block-scale grid (``X.weight`` + ``X.scale``) and MXFP4 routed experts (packed e2m1 bytes +
``..._scale`` e8m0 bytes, one per 32 values). ``weight_format`` decides their fate, never
silently: ``checkpoint`` keeps them as stored (the model runs the kernels package's FP8 and
MXFP4 GEMMs), ``dequantize`` turns them into the serving dtype with one vectorised operation per
tensor (the explicit way to get a bf16 model). Pure functions of tensors; never builds a model.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from engine.errors import CheckpointError
from kernels.fp8_linear_ref import dequantize_fp8_block, fp8_block_scale_fp32
from kernels.mxfp4_moe_ref import MXFP4_GROUP, as_bytes, dequantize_mxfp4

WEIGHT_FORMATS = ("checkpoint", "dequantize")
# The projections V4-Flash ships in FP8 (transformers names); its compressor / indexer
# weights_proj, router, norms, embedding and head are bf16 / fp32.
FP8_LINEAR = re.compile(
    r"(self_attn\.(q_a_proj|q_b_proj|kv_proj|o_a_proj|o_b_proj|compressor\.indexer\.q_b_proj)"
    r"|mlp\.shared_experts\.(gate_proj|up_proj|down_proj))\.weight$")
FP8_BLOCK = 128  # DeepSeek's block edge; the last block of a dimension may be partial
_FP4_DTYPES = (torch.int8, torch.uint8) + tuple(
    d for d in (getattr(torch, "float4_e2m1fn_x2", None),) if d is not None)
_EXPERT_LEAVES = ("gate_up_proj", "down_proj")
_E8M0 = getattr(torch, "float8_e8m0fnu", torch.uint8)


def has_mxfp4_experts(hf_config: Mapping[str, object]) -> bool:
    """Whether config.json declares FP4 routed experts (``expert_dtype: fp4``, top level or, as
    transformers moves it, inside ``quantization_config``)."""
    qc = hf_config.get("quantization_config")
    inner = qc.get("expert_dtype") if isinstance(qc, dict) else None
    return (inner or hf_config.get("expert_dtype")) == "fp4"


def has_fp8_linears(hf_config: Mapping[str, object]) -> bool:
    """Whether config.json declares FP8 block-quantized dense weights."""
    qc = hf_config.get("quantization_config")
    return isinstance(qc, dict) and qc.get("quant_method") == "fp8"


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == torch.float8_e4m3fn


def scale_name(weight_name: str) -> str:
    """``X.weight`` -> ``X.scale``; ``experts.gate_up_proj`` -> ``experts.gate_up_proj_scale``."""
    if weight_name.endswith(".weight"):
        return weight_name[: -len("weight")] + "scale"
    return weight_name + "_scale"


def quantized_weights(sd: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """weight name -> ``"fp8"`` | ``"mxfp4"`` for every payload with a scale beside it (an
    ``X.scale`` without ``X.weight`` is not one: the mHC's ``attn_hc.scale`` is a parameter).
    Raises on a payload kind the model cannot keep."""
    kinds: dict[str, str] = {}
    for name in sd:
        if not (name.endswith(".scale") or name.endswith("_proj_scale")):
            continue
        wname = name[: -len("scale")] + "weight" if name.endswith(".scale") else name[: -len("_scale")]
        if wname not in sd:
            continue
        w = sd[wname]
        if wname.rsplit(".", 1)[-1] in _EXPERT_LEAVES:
            if w.dtype not in _FP4_DTYPES:
                raise CheckpointError(
                    f"deepseek_v4: routed experts {wname!r} are {w.dtype}; only MXFP4 (packed e2m1) "
                    "experts are kept quantized: load with weight_format=dequantize")
            kinds[wname] = "mxfp4"
        elif is_fp8(w):
            kinds[wname] = "fp8"
        else:
            raise CheckpointError(f"deepseek_v4: {wname!r} has a scale but dtype {w.dtype}")
    return kinds


def fp8_block_of(name: str, weight_shape: torch.Size | tuple[int, ...],
                 grid_shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """The (rows, cols) block of a scale grid: DeepSeek's 128 x 128 when the grid is
    ``ceil(dim / 128)`` (last block partial), else the exact quotient as transformers derives it."""
    if len(grid_shape) != 2:
        raise CheckpointError(f"deepseek_v4: {name} scale grid must be 2-D, got {list(grid_shape)}")
    block = []
    for dim, cells in zip(weight_shape[-2:], grid_shape, strict=True):
        if cells == -(-dim // FP8_BLOCK):
            block.append(FP8_BLOCK)
        elif cells > 0 and dim % cells == 0:
            block.append(dim // cells)
        else:
            raise CheckpointError(
                f"deepseek_v4: {name} weight {list(weight_shape)} does not fit its scale grid "
                f"{list(grid_shape)} (neither ceil(dim/128) nor a divisor of the dim)")
    return block[0], block[1]


def e8m0_bytes(name: str, scale: torch.Tensor) -> torch.Tensor:
    """MXFP4 scales as e8m0 bytes: uint8 / float8_e8m0fnu as stored; fp32/bf16 only when every
    value is a power of two (anything else cannot be MXFP4 without changing the model)."""
    if scale.dtype == torch.uint8:
        return scale
    if scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        return scale.view(torch.uint8)
    exp = torch.log2(scale.float())
    if not bool(torch.isfinite(exp).all()) or not bool((exp == exp.round()).all()):
        raise CheckpointError(
            f"deepseek_v4: {name} holds scales that are not powers of two, which MXFP4 cannot "
            "keep: load with weight_format=dequantize")
    return (exp.round() + 127).clamp(0, 254).to(torch.uint8)


def check_mxfp4(name: str, packed: torch.Tensor, scale: torch.Tensor) -> None:
    rows, half = packed.shape[-2:]
    if (2 * half) % MXFP4_GROUP:
        raise CheckpointError(f"deepseek_v4: {name} packs {2 * half} values a row, not a multiple "
                              f"of {MXFP4_GROUP} (one e8m0 scale per {MXFP4_GROUP} values)")
    if tuple(scale.shape) != (*packed.shape[:-1], 2 * half // MXFP4_GROUP):
        raise CheckpointError(
            f"deepseek_v4: {name} packs {2 * half} values a row but its scales are "
            f"{list(scale.shape)}; MXFP4 needs one per {MXFP4_GROUP} ([..., {rows}, "
            f"{2 * half // MXFP4_GROUP}])")


def dequantize_all(sd: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every quantized payload of ``sd`` (model names) as ``dtype``, scales dropped: the explicit
    ``weight_format=dequantize`` path. One vectorised dequantization per tensor."""
    out = dict(sd)
    for wname, kind in quantized_weights(sd).items():
        sname = scale_name(wname)
        w, s = out.pop(wname), out.pop(sname)
        if kind == "fp8":
            out[wname] = dequantize_fp8_block(w, s, fp8_block_of(wname, w.shape, s.shape)).to(dtype)
        elif s.dtype in (torch.uint8, _E8M0):
            check_mxfp4(wname, w, s)
            out[wname] = dequantize_mxfp4(w, s).to(dtype)
        else:  # float scales need not be powers of two once dequantized
            check_mxfp4(wname, w, s)
            unit = torch.full(s.shape, 127, dtype=torch.uint8, device=s.device)
            out[wname] = (dequantize_mxfp4(w, unit) * s.float().repeat_interleave(MXFP4_GROUP, -1)).to(dtype)
    return out


def keep_quantized(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``sd`` with every scale in the form the kernels read (fp32 grids for FP8, e8m0 bytes for
    MXFP4), checked against its payload. The payloads are the stored tensors themselves."""
    out = dict(sd)
    for wname, kind in quantized_weights(sd).items():
        sname = scale_name(wname)
        w, s = sd[wname], sd[sname]
        if kind == "fp8":
            fp8_block_of(wname, w.shape, s.shape)
            out[sname] = fp8_block_scale_fp32(s)
        else:
            out[wname] = as_bytes(w)  # int8 / float4_e2m1fn_x2 -> uint8, a view
            out[sname] = e8m0_bytes(sname, s)
            check_mxfp4(wname, w, out[sname])
    return out


def resident_weight_bytes(state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype,
                          weight_format: str) -> int:
    """Device bytes of the weights once the model holds them: quantized payloads at their stored
    size (``checkpoint``) or at ``dtype`` (``dequantize``); fp32 block-scale grids. Works on the
    checkpoint's own names (either layout): a payload is quantized when a scale sits beside it."""
    elem = torch.empty((), dtype=dtype).element_size()
    scale_of = {s: name for name in state_dict for s in _scale_names(name) if s in state_dict}
    total = 0
    for name, t in state_dict.items():
        if name in scale_of:
            if weight_format == "checkpoint":  # FP8 grids become fp32, MXFP4's e8m0 bytes stay
                total += t.numel() * (4 if is_fp8(state_dict[scale_of[name]]) else t.element_size())
            continue
        if weight_format == "dequantize" and any(s in scale_of for s in _scale_names(name)):
            total += t.numel() * (2 if t.dtype in _FP4_DTYPES else 1) * elem
            continue
        total += t.numel() * t.element_size()
    return total


def _scale_names(weight_name: str) -> tuple[str, ...]:
    """Where a payload's scale may sit, in either layout."""
    if weight_name.endswith(".weight"):
        stem = weight_name[: -len("weight")]
        return stem + "scale", stem + "weight_scale_inv"
    return weight_name + "_scale", weight_name + "_scale_inv"
