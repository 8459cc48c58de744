"""Which DeepSeek-V4 projections run as one GEMM (merged_linear.py is how): the groups of one
input, merged once when the model is finalized after loading.

The groups (DeepSeek-V4-Flash: the FP8 ones are what the fused decode path was built for):

* attention, FP8: ``q_a_proj`` and ``kv_proj`` (both of the normed hidden ``x``);
* attention, bf16 in V4-Flash: the compressor's ``kv_proj`` / ``gate_proj`` and, in CSA layers,
  the indexer's ``kv_proj`` / ``gate_proj`` and ``scorer.weights_proj`` (all of ``x`` too);
* MoE, FP8: the shared expert's ``gate_proj`` and ``up_proj``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.models.deepseek_v4.layers.attention import V4Attention, V4CSACompressor
from engine.models.deepseek_v4.layers.merged_linear import MergedLinear, merge_linears
from engine.models.deepseek_v4.layers.moe import _SharedExpert


def merge_projections(model: nn.Module,
                      drop: Callable[[list[torch.Tensor]], None] | None = None) -> int:
    """Merge every group of the module docstring in ``model`` (a loaded DeepseekV4Model), in
    place; returns how many groups merged. ``drop`` gets each merged group's former tensors
    right after it merged, for the caller to let go of its references to them, so that they
    are freed before the next group is concatenated (loading never holds two copies of more
    than one group)."""
    count = 0

    def merge(parts: list[nn.Module]) -> MergedLinear | None:
        nonlocal count
        old = [t for p in parts for t in (p.weight, getattr(p, "scale", None)) if t is not None]
        merged = merge_linears(parts)
        if merged is not None:
            count += 1
            if drop is not None:
                drop(old)
        return merged

    for mod in model.modules():
        if isinstance(mod, V4Attention):
            mod.merged_x = merge([mod.q_a_proj, mod.kv_proj])
            comp = mod.compressor
            if comp is not None:
                parts = [comp.kv_proj, comp.gate_proj]
                if isinstance(comp, V4CSACompressor):
                    ix = comp.indexer
                    parts += [ix.kv_proj, ix.gate_proj, ix.scorer.weights_proj]
                mod.merged_comp = merge(parts)
        elif isinstance(mod, _SharedExpert):
            mod.merged_gate_up = merge([mod.gate_proj, mod.up_proj])
    return count


def unmerge_projections(model: nn.Module) -> None:
    """Run the parts one by one again (their weights stay views: benchmarks and tests compare)."""
    for mod in model.modules():
        if isinstance(mod, V4Attention):
            mod.merged_x = mod.merged_comp = None
        elif isinstance(mod, _SharedExpert):
            mod.merged_gate_up = None
