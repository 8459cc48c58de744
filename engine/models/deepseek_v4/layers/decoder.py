"""A DeepSeek-V4 decoder layer's modules (attention, MoE, their norms and hyper-connections)
and the backbone that holds them with the embedding, the final norm and the mHC head, under
transformers' ``model.*`` names. Parameters only: how a step runs them is model.py's (the
chunk path and the unfused decode loop) and step/decode_step.py's (the fused decode loop).
"""

from __future__ import annotations

from torch import nn

from engine.models.deepseek_v4.config import DeepseekV4Config
from engine.models.deepseek_v4.layers.attention import V4Attention
from engine.models.deepseek_v4.layers.mhc import HyperConnection, HyperHead
from engine.models.deepseek_v4.layers.moe import V4MoE
from engine.models.deepseek_v4.layers.norms import RMSNorm


class V4DecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = V4Attention(cfg, layer_idx)
        self.mlp = V4MoE(cfg, layer_idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(cfg)
        self.ffn_hc = HyperConnection(cfg)


class V4Backbone(nn.Module):
    """Holds the ``model.*`` tensors: embedding, decoder layers, final norm and mHC head."""

    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(V4DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg)
