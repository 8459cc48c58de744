"""DeepSeek-V4's multi-token-prediction (MTP) layers as a draft model for speculative decoding.

Structure (DeepSeek's description of V3's MTP modules and of V4's ``MTPBlock``; the code is
ours). MTP layer ``i`` at position ``p`` takes the main model's residual streams at ``p``
(``[hc, d]``, BEFORE the final mHC head) and the embedding of the token at ``p + 1``:

    x = h_proj(hnorm(h)) + e_proj(enorm(embed(token[p + 1])))      # broadcast over the hc streams
    x = block(x)                                                    # one V4 decoder block
    logits = head(norm(hc_head(x)))                                 # predicts token[p + 2]

``h_proj``/``e_proj`` are V3's ``eh_proj`` over ``[e; h]`` split in two; the embedding and the
LM head are the main model's; ``norm`` and ``hc_head`` are the layer's own. The block is a
sliding-window layer (no compressor, no indexer: the V4 release's ``mtp.*`` tensors have
none) with a routed MoE, so its only state is a window ring per slot (``mtp_carry`` in the
plan): this module keeps it in a one-layer :class:`DeepseekV4KVPool` of its own.

Checkpoint names: DeepSeek's layout, ``mtp.{i}.<the layer's tensors as layers.N.* name
them>`` plus ``mtp.{i}.{e_proj,h_proj,enorm,hnorm,norm}.weight`` and
``mtp.{i}.hc_head_{fn,base,scale}`` (the V4-Flash release). FP8 payloads are dequantized to
the engine dtype on load (one layer).

Drafting (``k`` tokens, mtp_drafter.py): draft 1 comes from MTP layer 0 at the sequence's
last computed position; drafts 2..k from the same layer 0 run RECURRENTLY on its own output
streams and the previous draft, so a checkpoint with one MTP layer (V4-Flash) still drafts ``k``
tokens. Layers past 0 are not used: layer ``j``'s window would need layer ``j - 1``'s output
streams at every earlier position, i.e. every MTP layer run over every position.

The drafter never decides an output token: every draft is verified by the main model, so a
cold or stale MTP window (after a prefix hit or a KV import, where no MTP state travels)
lowers acceptance only, never changes the tokens.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from engine.config import EngineConfig
from engine.errors import CheckpointError, PlanError
from engine.models.deepseek_v4.backend import V4Backend
from engine.models.deepseek_v4.config import SLIDING, DeepseekV4Config
from engine.models.deepseek_v4.layers.attention import V4Attention
from engine.models.deepseek_v4.layers.mhc import merge
from engine.models.deepseek_v4.layers.norms import RMSNorm
from engine.models.deepseek_v4.memory.kv_pool import DeepseekV4KVPool, LayerPool
from engine.models.deepseek_v4.model import DeepseekV4Model
from engine.models.deepseek_v4.weights.checkpoint_layout import to_hf_names

_MTP = re.compile(r"^(?:model\.)?mtp\.(\d+)\.(.+)$")
# the layer's own tensors beside its block, DeepSeek name -> ours
_GLUE = {"e_proj.weight": "e_proj.weight", "h_proj.weight": "h_proj.weight",
         "enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
         "norm.weight": "model.norm.weight", "hc_head_fn": "model.hc_head.hc_fn",
         "hc_head_base": "model.hc_head.hc_base", "hc_head_scale": "model.hc_head.hc_scale"}


def mtp_layer_count(state_dict: Mapping[str, torch.Tensor]) -> int:
    """MTP layers a checkpoint's tensors hold (``mtp.{i}.*``), 0 when none."""
    ids = {int(m.group(1)) for k in state_dict if (m := _MTP.match(k))}
    return max(ids) + 1 if ids else 0


def mtp_config(cfg: DeepseekV4Config) -> DeepseekV4Config:
    """The config of one MTP layer as a one-layer model: sliding attention, routed MoE."""
    return dataclasses.replace(cfg, num_layers=1, layer_types=(SLIDING,), mlp_layer_types=("moe",))


def split_mtp_weights(state_dict: Mapping[str, torch.Tensor], num_layers: int,
                      dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
    """Per MTP layer, its tensors under the names of :class:`V4MTPLayer` (dequantized to
    ``dtype``); the main layers' tensors are left alone. ``num_layers``: the main model's."""
    per: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in state_dict.items():
        m = _MTP.match(key)
        if m:
            per.setdefault(int(m.group(1)), {})[m.group(2)] = t
    if sorted(per) != list(range(len(per))):
        raise CheckpointError(f"deepseek_v4: MTP layers {sorted(per)} are not 0..{len(per) - 1}")
    out = []
    for i in range(len(per)):
        raw = per[i]
        glue = {ours: raw.pop(theirs) for theirs, ours in _GLUE.items() if theirs in raw}
        missing = sorted(set(_GLUE.values()) - set(glue))
        if missing:
            raise CheckpointError(f"deepseek_v4: MTP layer {i} lacks {missing}")
        block = to_hf_names({f"layers.{num_layers + i}.{k}": v for k, v in raw.items()}, dtype)
        prefix = f"model.layers.{num_layers + i}."
        layer = {"model.layers.0." + k.removeprefix(prefix): v for k, v in block.items()}
        out.append({k: v.to(dtype) if v.is_floating_point() and "hc_head" not in k else v
                    for k, v in (layer | glue).items()})
    return out


class V4MTPLayer(DeepseekV4Model):
    """One MTP layer: a one-layer V4 model whose input streams are built from the main model's
    streams and the next token's embedding (the embedding and the LM head are the main
    model's, set by :meth:`build`). Runs through the model's own step code (chunks, one-token
    rows, its own pool), with :attr:`h_in` holding each row's input streams for the step."""

    def __init__(self, cfg: DeepseekV4Config, backend: V4Backend | None = None) -> None:
        super().__init__(mtp_config(cfg), backend)
        d = cfg.hidden_size
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        self.enorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps)
        self.h_in: torch.Tensor | None = None  # [N, hc, d] the step's main-model streams
        self.streams_out: torch.Tensor | None = None  # [N, hc, d] after the block

    @classmethod
    def build(cls, cfg: DeepseekV4Config, weights: dict[str, torch.Tensor], main: DeepseekV4Model,
              dtype: torch.dtype, device: torch.device | str) -> V4MTPLayer:
        """The layer holding ``weights`` (one entry of :func:`split_mtp_weights`), sharing
        ``main``'s embedding and head."""
        sd = dict(weights)
        sd["model.embed_tokens.weight"] = main.model.embed_tokens.weight
        sd["lm_head.weight"] = main.lm_head.weight
        # an unfused decode: the fused loop (step/decode_step.py) builds its own input streams
        backend = dataclasses.replace(main.backend, decode="unfused")
        extra = {k: sd.pop(k) for k in ("e_proj.weight", "h_proj.weight", "enorm.weight",
                                        "hnorm.weight")}
        core = DeepseekV4Model.from_state_dict(mtp_config(cfg), sd, dtype, device, backend)
        with torch.device("meta"):  # every tensor is given below: allocate none here
            layer = cls(cfg, backend)
        layer.model, layer.lm_head = core.model, core.lm_head
        layer.main_rotary, layer.compress_rotary = core.main_rotary, core.compress_rotary
        for name, t in extra.items():
            mod = layer.get_submodule(name.rpartition(".")[0])
            want = torch.float32 if "norm" in name else dtype
            mod.weight = nn.Parameter(t.to(device=device, dtype=want), requires_grad=False)
        return layer.eval()

    def input_streams(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, d] the next tokens' embeddings -> the block's input streams [N, hc, d]."""
        assert self.h_in is not None and self.h_in.shape[0] == x.shape[0]
        h = self.h_proj(self.hnorm(self.h_in).to(self.h_proj.weight.dtype))
        e = self.e_proj(self.enorm(x).to(self.e_proj.weight.dtype))
        return (h + e.unsqueeze(1)).to(x.dtype)

    def _layers(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: DeepseekV4KVPool,
                ws: object | None,
                attend: Callable[[V4Attention, torch.Tensor, tuple[torch.Tensor, torch.Tensor],
                                  LayerPool], torch.Tensor]) -> torch.Tensor:
        """DeepseekV4Model's layer loop (non-kernel mHC) from :meth:`input_streams`; keeps the
        block's output streams in :attr:`streams_out` for the next recurrent draft."""
        streams = self.input_streams(self.model.embed_tokens(input_ids))
        layer = self.model.layers[0]
        attn: V4Attention = layer.self_attn
        post, comb, collapsed = layer.attn_hc(streams, False)
        a = attend(attn, layer.input_layernorm(collapsed), self.main_rotary(positions, streams.dtype),
                   cache.layers[0])
        streams = merge(post, comb, a, streams, False)
        post, comb, collapsed = layer.ffn_hc(streams, False)
        m = layer.mlp(layer.post_attention_layernorm(collapsed), input_ids, ws)
        streams = merge(post, comb, m, streams, False)
        self.streams_out = streams
        return self.model.norm(self.model.hc_head(streams, False))


def mtp_weights_for(cfg: DeepseekV4Config, weights: dict[str, torch.Tensor], ec: EngineConfig,
                    tp: Any, declared: int | None) -> dict[str, torch.Tensor]:
    """MTP layer 0's tensors (mtp.py), or PlanError naming the setting when there are none."""
    if tp is not None:
        raise PlanError("speculative_method=mtp: not with tensor_parallel_size > 1 (the MTP "
                        "layer is not split over ranks); use ngram or none")
    if mtp_layer_count(weights) == 0:
        raise PlanError("speculative_method=mtp: this checkpoint has no MTP layers (no "
                        "mtp.{i}.* tensors; config num_nextn_predict_layers="
                        f"{declared}); use speculative_method ngram or none")
    return split_mtp_weights(weights, cfg.num_layers, ec.torch_dtype)[0]
