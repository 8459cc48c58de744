"""DeepSeek-V4 MoE: hash-routed (frozen ``tid2eid`` table) or score-routed (sqrt-softplus +
correction bias) experts with clamped SwiGLU, plus one shared expert.

Parameter names follow transformers (``gate``, ``experts.gate_up_proj``, ``experts.down_proj``,
``shared_experts``). Scratch is bounded by tokens x top-k; never by vocabulary or context.
MXFP4 experts (:class:`..weights.quant_modules.Mxfp4Experts`) run fused through the kernels package;
bf16/fp32 experts run the per-expert loop below (a host sync per step: the eager path).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.deepseek_v4.config import DeepseekV4Config
from engine.models.deepseek_v4.weights.quant_modules import Mxfp4Experts


def _score(logits: torch.Tensor, func: str) -> torch.Tensor:
    if func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if func == "sigmoid":
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)


def _clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class _Router(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, is_hash: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        if is_hash:
            self.register_buffer(
                "tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.long)
            )
        else:
            self.register_buffer(
                "e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32)
            )


class _SharedExpert(nn.Module):
    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        hid, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_proj = nn.Linear(hid, inter, bias=False)
        self.up_proj = nn.Linear(hid, inter, bias=False)
        self.down_proj = nn.Linear(inter, hid, bias=False)
        self.limit = cfg.swiglu_limit
        # gate_proj + up_proj as one GEMM (merged_groups.py, set when the model is finalized)
        self.merged_gate_up: Any = None

    def gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """gate_proj(x), up_proj(x): one GEMM when merged (views of its output)."""
        if self.merged_gate_up is not None:
            gate, up = self.merged_gate_up(x)
            return gate, up
        return self.gate_proj(x), self.up_proj(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(_clamped_swiglu(*self.gate_up(x), self.limit))


class _Experts(nn.Module):
    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        e, hid, inter = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * inter, hid))
        self.down_proj = nn.Parameter(torch.empty(e, hid, inter))


class V4MoE(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, layer_idx: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.is_hash = cfg.mlp_layer_types[layer_idx] == "hash_moe"
        self.gate = _Router(cfg, self.is_hash)
        self.experts = _Experts(cfg)
        self.shared_experts = _SharedExpert(cfg)
        # tensor parallelism (tensor_parallel.py): this rank's experts start at expert_offset,
        # only rank 0 adds the shared expert, and ``reduce`` sums the ranks' outputs
        self.expert_offset = 0
        self.add_shared = True
        self.reduce: Any = None

    def route(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, hidden] -> (weights [N, k] (scaled), expert indices [N, k])."""
        scores = _score(F.linear(x, self.gate.weight), self.cfg.scoring_func)
        if self.is_hash:
            indices = self.gate.tid2eid[input_ids].long()
        else:
            biased = scores + self.gate.e_score_correction_bias
            indices = torch.topk(biased, self.cfg.num_experts_per_tok, dim=-1, sorted=False).indices
        w = scores.gather(1, indices)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * self.cfg.routed_scaling_factor, indices

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, ws: object | None = None) -> torch.Tensor:
        # x: [N, hidden] -> [N, hidden]
        if self.reduce is not None:
            return self.reduce(self._forward(x, input_ids, ws))
        return self._forward(x, input_ids, ws)

    def _forward(self, x: torch.Tensor, input_ids: torch.Tensor, ws: object | None) -> torch.Tensor:
        weights, indices = self.route(x, input_ids)
        if isinstance(self.experts, Mxfp4Experts):
            # fused: sorted on the device, one launch per GEMM for all experts, no host sync
            base = self.shared_experts(x) if self.add_shared else torch.zeros_like(x)
            if self.expert_offset or self.experts.shape[0] != self.cfg.n_routed_experts:
                # this rank's experts only: the other picks run expert 0 at weight 0
                local = indices - self.expert_offset
                mine = (local >= 0) & (local < self.experts.shape[0])
                weights, indices = torch.where(mine, weights, 0), torch.where(mine, local, 0)
            return self.experts.add_into(x, weights.float(), indices, base,
                                         self.cfg.swiglu_limit, ws)
        k = indices.shape[1]
        flat_e = indices.reshape(-1)
        order = torch.argsort(flat_e, stable=True)
        counts = torch.bincount(flat_e, minlength=self.cfg.n_routed_experts).tolist()
        token_of = order // k
        w_sorted = weights.reshape(-1)[order]
        out = torch.zeros_like(x)
        inter = self.cfg.moe_intermediate_size
        offset = 0
        first, num_local = self.expert_offset, self.experts.gate_up_proj.shape[0]
        for e, cnt in enumerate(counts):
            if cnt == 0 or not first <= e < first + num_local:  # none, or another rank's
                offset += cnt
                continue
            tok = token_of[offset : offset + cnt]
            gu = F.linear(x[tok], self.experts.gate_up_proj[e - first])  # [cnt, 2I]
            y = F.linear(
                _clamped_swiglu(gu[:, :inter], gu[:, inter:], self.cfg.swiglu_limit),
                self.experts.down_proj[e - first],
            )
            out.index_add_(0, tok, (y * w_sorted[offset : offset + cnt, None]).to(out.dtype))
            offset += cnt
        return out + self.shared_experts(x) if self.add_shared else out
