"""One DeepSeek-V4 attention block (sliding, CSA or HCA): low-rank queries, shared-KV MQA with
head_dim 512, partial interleaved RoPE, per-head sinks, grouped output projection.

Parameter names follow transformers' ``DeepseekV4Attention``. The module holds the parameters and
the per-token maths (projections, norms, RoPE, the output projection); how a step attends with
them lives in step/: chunk_attention.py (prefill chunks, mixed steps) and decode_step.py (one
token per sequence). Never touches the KV pool itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.models.deepseek_v4.backend import V4Backend
from engine.models.deepseek_v4.config import CSA, SLIDING, DeepseekV4Config
from engine.models.deepseek_v4.layers.compressor import V4Compressor
from engine.models.deepseek_v4.layers.indexer import V4Indexer
from engine.models.deepseek_v4.layers.merged_linear import MergedLinear
from engine.models.deepseek_v4.layers.norms import RMSNorm, rms_norm_row, unweighted_rms_norm
from engine.models.deepseek_v4.layers.rope import Rope, apply_rope_, rope_norm_, rotate_


@dataclass
class StepRows:
    """Per-token tensors of one layer's step (rows picked by :meth:`select`)."""

    q: torch.Tensor  # [N, H, D] rotated queries
    kv: torch.Tensor | None  # [N, D] rotated shared K=V (None: already in the window ring)
    kv_c: torch.Tensor | None = None  # compressor projections [N, width]
    gate_c: torch.Tensor | None = None
    kv_i: torch.Tensor | None = None  # indexer compressor projections [N, 2 * index_head_dim]
    gate_i: torch.Tensor | None = None
    idx_q: torch.Tensor | None = None  # [N, Hi, Di]
    idx_w: torch.Tensor | None = None  # [N, Hi] fp32
    picks: torch.Tensor | None = None  # [N, topk] int32 pool rows of the indexer's picks (side lane)

    def select(self, index: slice | torch.Tensor) -> StepRows:
        """These rows of every tensor (views for a slice, copies for an index tensor)."""
        return StepRows(**{k: None if v is None else v[index] for k, v in vars(self).items()})


class V4CSACompressor(V4Compressor):
    """CSA's overlapping compressor; owns the indexer (transformers: ``compressor.indexer``)."""

    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__(cfg.hidden_size, cfg.head_dim, cfg.csa_rate, True, cfg.rms_norm_eps)
        self.indexer = V4Indexer(cfg)


class GroupedLinear(nn.Module):
    """Block-diagonal projection: ``weight [groups * out_per_group, in_per_group]``."""

    def __init__(self, in_per_group: int, out_features: int, groups: int) -> None:
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(out_features, in_per_group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, groups, in_per_group] -> [N, groups * out_per_group]
        w = self.weight.view(self.groups, -1, x.shape[-1])  # [G, out/G, in]
        return torch.einsum("ngi,goi->ngo", x, w).flatten(1)


class V4Attention(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, layer_idx: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_type = cfg.layer_types[layer_idx]
        self.is_main_rope = self.layer_type == SLIDING
        h, d = cfg.num_heads, cfg.head_dim
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * d, bias=False)
        self.kv_proj = nn.Linear(cfg.hidden_size, d, bias=False)
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.o_a_proj = GroupedLinear(h * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, cfg.o_groups)
        self.o_b_proj = nn.Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.zeros(h, dtype=torch.float32))
        self.compressor: V4Compressor | None = None
        if self.layer_type == CSA:
            self.compressor = V4CSACompressor(cfg)
        elif self.layer_type != SLIDING:
            self.compressor = V4Compressor(
                cfg.hidden_size, d, cfg.hca_rate, False, cfg.rms_norm_eps
            )
        # one GEMM for the projections of x (merged_groups.py, set when the model is finalized):
        # q_a_proj + kv_proj, and the compressor's (+ the indexer's) kv / gate / weights_proj
        self.merged_x: MergedLinear | None = None
        self.merged_comp: MergedLinear | None = None

    def project_x(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q_a_proj(x), kv_proj(x): one GEMM when merged (views of its output)."""
        if self.merged_x is not None:
            q_a, kv = self.merged_x(x)
            return q_a, kv
        return self.q_a_proj(x), self.kv_proj(x)

    def project_compressors(self, x: torch.Tensor, t: StepRows) -> None:
        """The compressor's kv / gate projections of x into ``t`` and, in CSA layers, the
        indexer's kv / gate and score weights: one GEMM when merged (views of its output)."""
        comp = self.compressor
        if comp is None:
            return
        csa = isinstance(comp, V4CSACompressor)
        if self.merged_comp is None:
            t.kv_c, t.gate_c = comp.project(x)
            if csa:
                t.kv_i, t.gate_i = comp.indexer.project(x)
                t.idx_w = comp.indexer.score_weights(x)
            return
        outs = self.merged_comp(x)
        t.kv_c, t.gate_c = outs[0], outs[1]
        if csa:
            t.kv_i, t.gate_i = outs[2], outs[3]
            t.idx_w = comp.indexer.scale_scores(outs[4])

    def project(self, x: torch.Tensor, rope: Rope, backend: V4Backend) -> StepRows:
        """Every per-token projection of the step (queries, shared KV, compressor and indexer
        inputs); x: [N, hidden] (already input-normed)."""
        cfg = self.cfg
        n = x.shape[0]
        h, d = cfg.num_heads, cfg.head_dim
        cos, sin = rope
        kernels = backend.attention == "kernels"
        q_a, kv_raw = self.project_x(x)  # one GEMM when merged (views of its output)
        if kernels:
            # one pass a tensor (norm + rope in fp32, rounded once), as the fused decode path:
            # in PyTorch the rope of the [N, H, D] queries alone is ~10 fp32 temporaries of
            # [N, H, R/2] (~350 MiB written at a 4096-token chunk), the norms an fp32 copy each
            q_res = rms_norm_row(q_a, self.q_a_norm.weight, self.q_a_norm.eps)
            q = rotate_(self.q_b_proj(q_res).view(n, h, d), rope, norm=True, eps=cfg.rms_norm_eps)
            kv = rope_norm_(kv_raw, rope, self.kv_norm.weight, self.kv_norm.eps)
        else:
            q_res = self.q_a_norm(q_a)  # [N, q_lora_rank]
            q = unweighted_rms_norm(self.q_b_proj(q_res).view(n, h, d), cfg.rms_norm_eps)
            q = apply_rope_(q, cos, sin)  # [N, H, D] (fresh tensors: rotated in place)
            kv = apply_rope_(self.kv_norm(kv_raw), cos, sin)  # [N, D]
        t = StepRows(q=q, kv=kv)
        self.project_compressors(x, t)
        if isinstance(self.compressor, V4CSACompressor):
            t.idx_q = self.compressor.indexer.index_queries(q_res, cos, sin, kernels)
        return t

    def output(self, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               kernels: bool = False) -> torch.Tensor:
        """Attention output [N, H, D] -> [N, hidden]: undo the rotation V picked up (K == V),
        then the grouped low-rank output projection (``kernels``: the rotation as one launch)."""
        out = rotate_(out, (cos, -sin)) if kernels else apply_rope_(out, cos, -sin)
        grouped = self.o_a_proj(out.view(out.shape[0], self.cfg.o_groups, -1))
        return self.o_b_proj(grouped)

    @property
    def rate(self) -> int:
        """The compression rate of this layer's entries (0: sliding only)."""
        return 0 if self.compressor is None else self.compressor.rate
