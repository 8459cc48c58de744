"""DeepSeek-V4 split over tensor-parallel ranks, the way the operator runs V4-Flash at TP=2.

Each rank keeps its share of the query heads (q_b_proj rows, sinks) with the output-projection
groups that read them (o_a_proj groups, o_b_proj columns; the partial outputs are all-reduced),
and its share of the routed experts (the router stays whole: every rank routes every token, and
runs only the experts it holds; rank 0 adds the shared expert; the MoE output is all-reduced).
The single shared KV head, the compressors, the indexer, the mHC, embedding and head stay whole,
so every rank writes the same KV into its own pool. Each rank reads only its slices of the
checkpoint (``tensor_slices.py``); ``cut_model`` gives the model skeleton (on the meta device,
before the tensors are adopted) the rank's shapes and ``wire_model`` adds the all-reduces. FP8
layers are cut with their block-scale grid (a cut must fall on a block boundary or inside one
block row); MXFP4 experts keep the picks of the other ranks' experts at weight 0.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from engine.errors import PlanError
from engine.models.deepseek_v4.config import DeepseekV4Config
from engine.models.deepseek_v4.layers.attention import V4Attention
from engine.models.deepseek_v4.layers.moe import V4MoE
from engine.models.deepseek_v4.weights.quant_modules import Fp8Linear, Mxfp4Experts

#: the fields one rank holds a share of (the rest of the config is whole on every rank)
SPLIT_FIELDS = ("num_attention_heads", "o_groups", "n_routed_experts")
FULL_KEY = "_tensor_parallel_full"  # the whole model's values of SPLIT_FIELDS in a rank's config


class _Reduced(nn.Module):
    """A row-parallel projection: the wrapped module's partial output summed over the ranks."""

    def __init__(self, inner: nn.Module, tp: Any) -> None:
        super().__init__()
        self.inner = inner
        self.tp = tp

    def forward(self, *args: Any) -> torch.Tensor:
        return self.tp.all_reduce(self.inner(*args))


class _Flat(nn.Module):
    """A block-diagonal projection left with one group: [N, 1, in] -> [N, out], as before."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).flatten(1)


def rank_hf_config(hf: dict[str, Any], size: int, name: str) -> dict[str, Any]:
    """``hf`` as one rank of ``size`` sees it (the whole values kept under FULL_KEY)."""
    v4 = DeepseekV4Config.from_hf_dict(hf)
    full = {"num_attention_heads": v4.num_heads, "o_groups": v4.o_groups,
            "n_routed_experts": v4.n_routed_experts}
    bad = [f"{k}={v}" for k, v in full.items() if v % size]
    if bad:
        raise PlanError(f"tensor_parallel_size={size} does not split {name}: " + ", ".join(bad)
                        + f" is not a multiple of {size}")
    return {**hf, **{k: v // size for k, v in full.items()}, FULL_KEY: full}


def whole_hf_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The whole model's config.json dict back from a rank's."""
    out = {k: v for k, v in hf.items() if k != FULL_KEY}
    out.update(hf.get(FULL_KEY, {}))
    return out


def cut_model(model: nn.Module, cfg: DeepseekV4Config, rank: int, size: int) -> None:
    """Give ``model`` (built whole, on any device, meta included) rank ``rank``'s shapes: its
    query heads, output groups and routed experts; in place."""
    heads, groups = cfg.num_heads // size, cfg.o_groups // size
    for mod in model.modules():
        if isinstance(mod, V4Attention):
            d = cfg.head_dim
            _cut(mod.q_b_proj, 0, rank * heads * d, heads * d)
            mod.sinks = nn.Parameter(mod.sinks.data[rank * heads:(rank + 1) * heads].clone(),
                                     requires_grad=False)
            per_group = cfg.o_lora_rank
            _cut(mod.o_a_proj, 0, rank * groups * per_group, groups * per_group)
            mod.o_a_proj.groups = groups
            _cut(mod.o_b_proj, 1, rank * groups * per_group, groups * per_group)
        elif isinstance(mod, V4MoE):
            per = cfg.n_routed_experts // size
            names = ["gate_up_proj", "down_proj"]
            if isinstance(mod.experts, Mxfp4Experts):
                names += ["gate_up_proj_scale", "down_proj_scale"]
                mod.experts.shape = (per, *mod.experts.shape[1:])
            for name in names:
                _keep_rows(mod.experts, name, rank * per, per)


def wire_model(model: nn.Module, cfg: DeepseekV4Config, rank: int, tp: Any) -> None:
    """A cut model (``cut_model``, its tensors adopted) as a rank runs it: the row-parallel
    outputs all-reduced, the experts offset, the shared expert added once (by rank 0)."""
    size = tp.size
    local = dataclasses.replace(cfg, num_heads=cfg.num_heads // size,
                                o_groups=cfg.o_groups // size)
    for mod in model.modules():
        if isinstance(mod, V4Attention):
            if local.o_groups == 1 and isinstance(mod.o_a_proj, Fp8Linear):
                mod.o_a_proj = _Flat(mod.o_a_proj)  # now a plain FP8 linear
            mod.o_b_proj = _Reduced(mod.o_b_proj, tp)
            mod.cfg = local
        elif isinstance(mod, V4MoE):
            mod.expert_offset = rank * (cfg.n_routed_experts // size)
            mod.add_shared = rank == 0
            mod.reduce = tp.all_reduce


def _keep_rows(mod: nn.Module, attr: str, start: int, length: int) -> None:
    _set(mod, attr, getattr(mod, attr).data[start:start + length].contiguous())


def _set(mod: nn.Module, attr: str, t: torch.Tensor) -> None:
    if attr in mod._buffers:
        mod._buffers[attr] = t
    else:
        setattr(mod, attr, nn.Parameter(t, requires_grad=False))


def _cut(mod: nn.Module, dim: int, start: int, length: int) -> None:
    """Keep ``[start, start + length)`` of the weight's ``dim`` (0: rows, 1: columns); an FP8
    weight keeps the block scales of what it keeps."""
    w = mod.weight.data
    _set(mod, "weight", w.narrow(dim, start, length).contiguous())
    if not isinstance(mod, Fp8Linear) or mod.scale.numel() == 0:
        return  # a skeleton's empty grid: the adopted tensor brings the rank's rows
    b = mod.block[dim]
    first, last = start // b, (start + length - 1) // b
    if start % b and first != last:
        raise PlanError(f"DeepSeek-V4 FP8 weight of {tuple(w.shape)} cannot be cut at {start} "
                        f"(dim {dim}): not on a {b}-wide scale block boundary")
    _set(mod, "scale", mod.scale.narrow(dim, first, last - first + 1).contiguous())
