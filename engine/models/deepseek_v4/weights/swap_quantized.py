"""A DeepSeek-V4 skeleton's modules swapped for their quantized forms (quant_modules.py) where
the checkpoint keeps a weight quantized: on the meta device, before any tensor is adopted, so
the model is built in the checkpoint's formats and never holds a dequantized copy.
"""

from __future__ import annotations

from torch import nn

from engine.errors import CheckpointError
from engine.models.deepseek_v4.layers.attention import GroupedLinear
from engine.models.deepseek_v4.layers.moe import _Experts
from engine.models.deepseek_v4.weights.quant_modules import Fp8Linear, Mxfp4Experts


def swap_quantized_modules(model: nn.Module, kinds: dict[str, str]) -> None:
    """Replace, in place, the module owning each quantized weight (``kinds``: weight name ->
    "fp8" | "mxfp4", from :func:`.quant_weights.quantized_weights`) by its quantized form."""
    for wname, kind in kinds.items():
        mod_name = wname.rsplit(".", 1)[0]
        parent_name, _, attr = mod_name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, attr, None)
        if kind == "mxfp4":
            if isinstance(old, Mxfp4Experts):
                continue
            if not isinstance(old, _Experts):
                raise CheckpointError(f"deepseek_v4: {wname} is MXFP4 but belongs to a {type(old).__name__}")
            e, two_i, hid = old.gate_up_proj.shape
            setattr(parent, attr, Mxfp4Experts(e, hid, two_i // 2))
        elif isinstance(old, GroupedLinear):
            setattr(parent, attr, Fp8Linear(tuple(old.weight.shape), groups=old.groups))
        elif isinstance(old, nn.Linear):
            setattr(parent, attr, Fp8Linear(tuple(old.weight.shape)))
        else:
            raise CheckpointError(f"deepseek_v4: {wname} is FP8, which a {type(old).__name__} cannot "
                                  "keep: load with weight_format=dequantize")
