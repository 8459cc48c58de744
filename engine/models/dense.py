"""Llama, Qwen2 and Qwen3: one dense decoder that reads top to bottom.

Differences between the families are data, not subclasses: q/k/v bias (Qwen2) is present when the
checkpoint has it, per-head q/k RMSNorm (Qwen3) when the config says so. Attention goes through
engine.attention (tiled, workspace-backed); no step builds anything whose size depends on context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.attention import AttentionShape, paged_attention
from engine.errors import CheckpointError
from engine.kv_cache import KVCache
from engine.model_config import ModelConfig
from engine.rope import RotaryTable
from engine.step_batch import StepBatch
from engine.workspace import Workspace

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As transformers: normalise in fp32, cast back, then scale.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@dataclass
class _Layer:
    input_norm: torch.Tensor
    q: torch.Tensor | None  # the unfused path's projections (None when fused)
    k: torch.Tensor | None
    v: torch.Tensor | None
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    gate: torch.Tensor | None
    up: torch.Tensor | None
    down: torch.Tensor
    qkv: torch.Tensor | None = None  # fused path: [q; k; v] rows, one GEMM
    qkv_bias: torch.Tensor | None = None
    gate_up: torch.Tensor | None = None  # fused path: [gate; up] rows, one GEMM


def _fuse_projections(layer: _Layer, weights: dict[str, torch.Tensor], prefix: str) -> None:
    """Concatenate q/k/v and gate/up into one weight each, dropping the originals from
    ``weights`` (the engine owns that dict) so each layer's old copies are freed before the next
    layer's are made: start-up never holds two copies of the model."""
    # Weights shared between processes (engine/weight_share.py) come already concatenated in
    # one arena, the parts being row views of it: use them as they are, copying nothing.
    qkv = weights.pop(prefix + "self_attn.qkv_proj.weight", None)
    qkv_bias = weights.pop(prefix + "self_attn.qkv_proj.bias", None)
    gate_up = weights.pop(prefix + "mlp.gate_up_proj.weight", None)
    layer.qkv = qkv if qkv is not None else torch.cat([layer.q, layer.k, layer.v])
    if layer.q_bias is not None:
        layer.qkv_bias = qkv_bias if qkv_bias is not None else \
            torch.cat([layer.q_bias, layer.k_bias, layer.v_bias])
    layer.gate_up = gate_up if gate_up is not None else torch.cat([layer.gate, layer.up])
    layer.q = layer.k = layer.v = layer.gate = layer.up = None
    layer.q_bias = layer.k_bias = layer.v_bias = None
    for name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight"):
        weights.pop(prefix + name, None)
    if layer.qkv.is_cuda:
        torch.cuda.empty_cache()  # start-up only: hand the freed originals back to the device


class DenseDecoder:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], rope: RotaryTable,
                 attn_shape: AttentionShape, fused: bool = False, tp: Any = None) -> None:
        """``tp`` (engine/parallel/rank_group.py ``RankGroup``, or None for one rank): ``cfg``
        and ``weights`` are then this rank's share (engine/parallel/shard_plan.py), and the
        partial sums of o_proj and down_proj are all-reduced."""
        self.cfg = cfg
        self.tp = tp
        # fused: the Triton elementwise kernels of kernels.fused (norm+residual, rope+KV write,
        # SiLU-and-multiply) instead of the PyTorch ops; same numbers, ~3x fewer kernels a layer.
        self.fused = fused and rope.rotary_dim == cfg.head_dim
        self.rope = rope
        self.attn_shape = attn_shape
        self.scale = cfg.head_dim ** -0.5
        act = cfg.hf_config.get("hidden_act", "silu")
        if act not in _ACTIVATIONS:
            raise CheckpointError(f"unsupported hidden_act {act!r} in config.json")
        self.act = _ACTIVATIONS[act]
        self.embed = weights["model.embed_tokens.weight"]
        self.final_norm = weights["model.norm.weight"]
        self.lm_head = weights.get("lm_head.weight", self.embed) if not cfg.tie_word_embeddings \
            else self.embed
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            self.layers.append(_Layer(
                input_norm=weights[p + "input_layernorm.weight"],
                q=weights[a + "q_proj.weight"], k=weights[a + "k_proj.weight"],
                v=weights[a + "v_proj.weight"],
                q_bias=weights.get(a + "q_proj.bias"), k_bias=weights.get(a + "k_proj.bias"),
                v_bias=weights.get(a + "v_proj.bias"),
                o=weights[a + "o_proj.weight"], o_bias=weights.get(a + "o_proj.bias"),
                q_norm=weights.get(a + "q_norm.weight") if cfg.qk_norm else None,
                k_norm=weights.get(a + "k_norm.weight") if cfg.qk_norm else None,
                post_norm=weights[p + "post_attention_layernorm.weight"],
                gate=weights[p + "mlp.gate_proj.weight"], up=weights[p + "mlp.up_proj.weight"],
                down=weights[p + "mlp.down_proj.weight"],
            ))
            if self.fused:
                _fuse_projections(self.layers[-1], weights, p)

    def forward(self, batch: StepBatch, kv: KVCache, ws: Workspace) -> torch.Tensor:
        """-> hidden states [N, hidden] after the last layer (before the final norm)."""
        if self.fused:
            return self._forward_fused(batch, kv, ws)
        cfg = self.cfg
        n = batch.num_tokens
        h, hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        x = F.embedding(batch.input_ids, self.embed)
        for i, layer in enumerate(self.layers):
            residual = x
            y = rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
            q = F.linear(y, layer.q, layer.q_bias).view(n, h, d)
            k = F.linear(y, layer.k, layer.k_bias).view(n, hk, d)
            v = F.linear(y, layer.v, layer.v_bias).view(n, hk, d)
            if layer.q_norm is not None:
                q = rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
                k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
            q = self.rope.apply(q, batch.positions)
            k = self.rope.apply(k, batch.positions)
            kv.write(i, batch.slot_mapping, k, v)
            k_cache, v_cache = kv.layer(i)
            attn = torch.empty_like(q)
            paged_attention(q, k_cache, v_cache, batch, self.scale, attn, ws, self.attn_shape)
            x = residual + self._reduced(F.linear(attn.view(n, h * d), layer.o, layer.o_bias))
            residual = x
            y = rms_norm(x, layer.post_norm, cfg.rms_norm_eps)
            x = residual + self._reduced(
                F.linear(self.act(F.linear(y, layer.gate)) * F.linear(y, layer.up), layer.down))
        return x

    def _reduced(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's output summed over the ranks (itself on one rank)."""
        return partial if self.tp is None else self.tp.all_reduce(partial)

    def _forward_fused(self, batch: StepBatch, kv: KVCache, ws: Workspace) -> torch.Tensor:
        """``forward`` with the fused kernels: the residual stream is updated in place by the
        add+norm kernel, and q/k rotation writes k and v straight into the paged cache."""
        from kernels.fused import add_rms_norm, rope_and_cache, silu_and_mul

        cfg = self.cfg
        n = batch.num_tokens
        h, hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        residual = F.embedding(batch.input_ids, self.embed)  # [N, hidden], updated in place
        x: torch.Tensor | None = None  # the last sublayer's output, not yet added
        for i, layer in enumerate(self.layers):
            y = add_rms_norm(x if x is not None else residual, residual if x is not None else None,
                             layer.input_norm, eps, torch.empty_like(residual))
            qkv = F.linear(y, layer.qkv, layer.qkv_bias)  # [N, (h + 2 hk) d]
            q = qkv[:, : h * d].view(n, h, d)
            k = qkv[:, h * d : (h + hk) * d].view(n, hk, d)
            v = qkv[:, (h + hk) * d :].view(n, hk, d)
            if layer.q_norm is not None:
                q = add_rms_norm(q.reshape(n * h, d), None, layer.q_norm, eps,
                                 q.new_empty(n * h, d)).view(n, h, d)
                k = add_rms_norm(k.reshape(n * hk, d), None, layer.k_norm, eps,
                                 k.new_empty(n * hk, d)).view(n, hk, d)
            k_cache, v_cache = kv.layer(i)
            q_rot = rope_and_cache(q, k, v, batch.positions, self.rope.cos, self.rope.sin,
                                   batch.slot_mapping, k_cache, v_cache, torch.empty_like(q))
            attn = torch.empty_like(q_rot)
            paged_attention(q_rot, k_cache, v_cache, batch, self.scale, attn, ws, self.attn_shape)
            x = self._reduced(F.linear(attn.view(n, h * d), layer.o, layer.o_bias))
            y = add_rms_norm(x, residual, layer.post_norm, eps, torch.empty_like(residual))
            gate_up = F.linear(y, layer.gate_up)  # [N, 2 I]
            inter = gate_up.shape[1] // 2
            gate, up = gate_up[:, :inter], gate_up[:, inter:]
            act = silu_and_mul(gate, up, gate.new_empty(n, inter)) if self.act is F.silu \
                else self.act(gate) * up
            x = self._reduced(F.linear(act, layer.down))
        assert x is not None
        return residual.add_(x)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> out [n, vocab] fp32."""
        y = rms_norm(hidden, self.final_norm, self.cfg.rms_norm_eps)
        out.copy_(F.linear(y, self.lm_head))
        return out
