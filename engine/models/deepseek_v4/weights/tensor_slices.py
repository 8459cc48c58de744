"""Which bytes of a DeepSeek-V4 checkpoint one tensor-parallel rank reads.

The split is the one ``tensor_parallel.py`` runs: a run of the query heads (``wq_b`` rows, the
attention sinks), the output groups that read them (``wo_a`` rows, ``wo_b`` columns) and a run of
the routed experts; every other tensor is whole on every rank. FP8 weights bring the rows or
columns of their block-scale grid that cover the rank's cut, so a rank never reads another
rank's heads, and another rank's experts (per-expert tensors in DeepSeek's layout) are not read
at all. Both layouts a V4 checkpoint comes in are named here: DeepSeek's own (the V4-Flash
files) and transformers' (``save_pretrained`` of its model). Pure functions of names and shapes:
never opens a file.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from engine.errors import PlanError
from engine.models.deepseek_v4.config import DeepseekV4Config
from engine.models.deepseek_v4.weights.quant_weights import fp8_block_of
from engine.parallel.shard_plan import ABSENT, TensorSlice

# (role, dim of the weight the rank cuts) by the tensor's name after ``layers.N.``
_ROLES: tuple[tuple[str, str, int], ...] = (
    ("attn.wq_b.", "heads", 0), ("self_attn.q_b_proj.", "heads", 0),
    ("attn.wo_a.", "groups", 0), ("self_attn.o_a_proj.", "groups", 0),
    ("attn.wo_b.", "groups", 1), ("self_attn.o_b_proj.", "groups", 1),
)
_SINKS = ("attn.attn_sink", "self_attn.sinks")
_LAYER = re.compile(r"^(?:model\.)?layers\.\d+\.(.+)$")
_DS_EXPERT = re.compile(r"^ffn\.experts\.(\d+)\.w[123]\.(weight|scale)$")
_HF_EXPERTS = re.compile(r"^mlp\.experts\.(gate_up_proj|down_proj)(_scale_inv|_scale)?$")
_SCALES = ("scale", "weight_scale_inv")


def v4_tensor_slicer(hf: dict[str, Any], rank: int, size: int,
                     shapes: Mapping[str, tuple[int, ...]]) -> Callable[[str], TensorSlice | None]:
    """``name -> TensorSlice | None`` for rank ``rank`` of ``size`` (``hf``: the whole model's
    config.json; ``shapes``: the checkpoint's tensor shapes, for the scale grids)."""
    cfg = DeepseekV4Config.from_hf_dict(hf)
    heads, groups = cfg.num_heads // size, cfg.o_groups // size
    experts = cfg.n_routed_experts // size
    runs = {"heads": heads * cfg.head_dim, "groups": groups * cfg.o_lora_rank}

    def slice_of(name: str) -> TensorSlice | None:
        m = _LAYER.match(name)
        if m is None:
            return None
        rest = m.group(1)
        if rest in _SINKS:
            return TensorSlice(0, rank * heads, heads)
        e = _DS_EXPERT.match(rest)
        if e is not None:
            mine = rank * experts <= int(e.group(1)) < (rank + 1) * experts
            return None if mine else ABSENT
        if _HF_EXPERTS.match(rest):
            return TensorSlice(0, rank * experts, experts)
        for prefix, role, dim in _ROLES:
            if not rest.startswith(prefix):
                continue
            leaf = rest[len(prefix):]
            start, length = rank * runs[role], runs[role]
            if leaf == "weight":
                return TensorSlice(dim, start, length)
            if leaf in _SCALES:
                stem = name[: -len(leaf)]
                return _grid_slice(name, shapes[stem + "weight"], shapes[name], dim, start, length)
        return None

    return slice_of


def _grid_slice(name: str, weight_shape: tuple[int, ...], grid_shape: tuple[int, ...], dim: int,
                start: int, length: int) -> TensorSlice:
    """The rows (dim 0) or columns (dim 1) of a block-scale grid that cover ``[start, start +
    length)`` of the weight's ``dim``. A cut must start on a block boundary unless it stays
    inside one block (both ranks then read that block's scales)."""
    b = fp8_block_of(name, weight_shape, grid_shape)[dim]
    first, last = start // b, (start + length - 1) // b
    if start % b and first != last:
        raise PlanError(f"DeepSeek-V4 FP8 weight {name} of {tuple(weight_shape)} cannot be cut at "
                        f"{start} (dim {dim}): not on a {b}-wide scale block boundary")
    return TensorSlice(dim, first, last - first + 1)


def renumber_experts(weights: dict[str, Any], rank: int, size: int, num_experts: int) -> None:
    """A rank's per-expert tensors (DeepSeek's layout) renamed in place from their global index
    to 0..E/size-1, the experts the rank's model holds; the other ranks' are absent already."""
    per = num_experts // size
    for key in [k for k in weights if ".ffn.experts." in k]:
        head, _, tail = key.partition(".ffn.experts.")
        index, _, leaf = tail.partition(".")
        local = int(index) - rank * per
        assert 0 <= local < per, f"{key}: another rank's expert reached rank {rank}"
        weights[f"{head}.ffn.experts.{local}.{leaf}"] = weights.pop(key)
