"""DeepSeek-V4 checkpoint layouts -> the transformers tensor names the model is built with.

DeepSeek's own layout (``embed.weight``, ``layers.N.attn.wq_a.weight``, per-expert
``ffn.experts.E.w1.weight``, FP8 weights with a ``.scale`` per 128x128 block, FP4-packed expert
weights with a scale per 32 columns) is what the V4-Flash files hold and also what transformers'
``save_pretrained`` writes back for this model (with a ``model.`` prefix). This module renames
and merges those tensors the way transformers' conversion mapping does, and dequantizes FP8/FP4
payloads the way its ``Fp8Dequantize`` does. Pure functions of a state dict: never builds a
model, never touches a device the tensors are not already on. With ``keep_quantized`` the FP8 /
FP4 payloads keep their stored form and their scales travel under the model's names
(``X.scale``, ``experts.gate_up_proj_scale``); :mod:`.quant_weights` decides what the model does
with them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from engine.errors import CheckpointError

_FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# Suffix renames inside ``layers.N.`` (DeepSeek name -> transformers name).
_LAYER_RENAMES: tuple[tuple[str, str], ...] = (
    ("attn_norm.", "input_layernorm."),
    ("ffn_norm.", "post_attention_layernorm."),
    ("hc_attn_fn", "attn_hc.fn"),
    ("hc_attn_base", "attn_hc.base"),
    ("hc_attn_scale", "attn_hc.scale"),
    ("hc_ffn_fn", "ffn_hc.fn"),
    ("hc_ffn_base", "ffn_hc.base"),
    ("hc_ffn_scale", "ffn_hc.scale"),
    ("attn.attn_sink", "self_attn.sinks"),
    ("attn.indexer.compressor.", "self_attn.compressor.indexer."),
    ("attn.indexer.weights_proj.", "self_attn.compressor.indexer.scorer.weights_proj."),
    ("attn.indexer.wq_b.", "self_attn.compressor.indexer.q_b_proj."),
    ("attn.compressor.", "self_attn.compressor."),
    ("attn.wq_a.", "self_attn.q_a_proj."),
    ("attn.wq_b.", "self_attn.q_b_proj."),
    ("attn.q_norm.", "self_attn.q_a_norm."),
    ("attn.wkv.", "self_attn.kv_proj."),
    ("attn.kv_norm.", "self_attn.kv_norm."),  # the V4-Flash files' name
    ("attn.norm.", "self_attn.kv_norm."),  # transformers' save_pretrained
    ("attn.wo_a.", "self_attn.o_a_proj."),
    ("attn.wo_b.", "self_attn.o_b_proj."),
    ("ffn.gate.bias", "mlp.gate.e_score_correction_bias"),
    ("ffn.gate.", "mlp.gate."),
    ("ffn.shared_experts.w1.", "mlp.shared_experts.gate_proj."),
    ("ffn.shared_experts.w2.", "mlp.shared_experts.down_proj."),
    ("ffn.shared_experts.w3.", "mlp.shared_experts.up_proj."),
)
# Inside a compressor (after the prefix rename above).
_COMPRESSOR_LEAVES = (("ape", "position_bias"), ("norm.", "kv_norm."), ("wgate.", "gate_proj."),
                      ("wkv.", "kv_proj."))
_TOP_RENAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
    # transformers' save_pretrained leaves these in its own names
    "embed_tokens.weight": "model.embed_tokens.weight",
    "lm_head.weight": "lm_head.weight",
    "hc_head.hc_fn": "model.hc_head.hc_fn",
    "hc_head.hc_base": "model.hc_head.hc_base",
    "hc_head.hc_scale": "model.hc_head.hc_scale",
}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.(weight|scale)$")


def is_deepseek_layout(state_dict: Mapping[str, torch.Tensor]) -> bool:
    """True when the names are DeepSeek's own (``layers.N.attn.*``), with or without ``model.``."""
    return any(re.match(r"^(model\.)?layers\.\d+\.(attn|ffn)\.", k) for k in state_dict)


def dequantize_block(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 (float8_e4m3fn) or FP4-packed (int8, two e2m1 per byte, low nibble first) ``weight``
    times its block ``scale`` grid (fp32, float8_e8m0fnu, or uint8 e8m0 exponents). The block
    shape is the weight's shape over the grid's, as transformers derives it."""
    if weight.dtype == torch.int8 or weight.dtype == getattr(torch, "float4_e2m1fn_x2", None):
        lut = torch.tensor(_FP4_E2M1, dtype=torch.float32, device=weight.device)
        u8 = weight.contiguous().view(torch.uint8)
        w = torch.stack([lut[(u8 & 0xF).long()], lut[((u8 >> 4) & 0xF).long()]], dim=-1)
        w = w.reshape(*weight.shape[:-1], 2 * weight.shape[-1])
    else:
        w = weight.to(torch.float32)
    s = (scale.to(torch.float32) - 127.0).exp2() if scale.dtype == torch.uint8 else scale.to(torch.float32)
    if s.dim() == w.dim() - 1:
        s = s.unsqueeze(0)
    rows, cols = w.shape[-2:]
    s_rows, s_cols = s.shape[-2:]
    if rows % s_rows or cols % s_cols:
        raise CheckpointError(
            f"deepseek_v4: weight {tuple(w.shape)} is not divisible by its scale grid {tuple(s.shape)}"
        )
    s = s.repeat_interleave(rows // s_rows, dim=-2).repeat_interleave(cols // s_cols, dim=-1)
    return (w * s).to(dtype)


def dequantize_hf(sd: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Fold every ``X.scale`` / ``X.weight_scale_inv`` / ``X_scale_inv`` into its weight."""
    out = dict(sd)
    for key in list(sd):
        if key.endswith(".scale") and key[: -len(".scale")] + ".weight" in sd:
            wkey = key[: -len(".scale")] + ".weight"
        elif key.endswith(".weight_scale_inv"):
            wkey = key[: -len("_scale_inv")]
        elif key.endswith("_scale_inv") and key[: -len("_scale_inv")] in sd:
            wkey = key[: -len("_scale_inv")]  # fused expert tensors: gate_up_proj_scale_inv
        else:
            continue
        if wkey not in sd:
            raise CheckpointError(f"deepseek_v4: scale {key!r} has no weight {wkey!r}")
        out[wkey] = dequantize_block(sd[wkey], sd[key], dtype)
        del out[key]
    return out


def _rename_layer_rest(rest: str) -> str:
    for old, new in _LAYER_RENAMES:
        if rest.startswith(old):
            rest = new + rest[len(old) :]
            break
    else:
        raise CheckpointError(f"deepseek_v4: unknown tensor 'layers.N.{rest}' in a DeepSeek-layout checkpoint")
    for marker in ("self_attn.compressor.indexer.", "self_attn.compressor."):
        if rest.startswith(marker):
            leaf = rest[len(marker) :]
            for old, new in _COMPRESSOR_LEAVES:
                if leaf.startswith(old):
                    return marker + new + leaf[len(old) :]
            return rest
    return rest


def hf_quantized_names(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers-named state dict with its scales under the model's names: ``X.scale``
    for ``X.weight_scale_inv`` and ``experts.gate_up_proj_scale`` for ``..._scale_inv``."""
    out: dict[str, torch.Tensor] = {}
    for key, t in sd.items():
        if key.endswith(".weight_scale_inv"):
            key = key[: -len("weight_scale_inv")] + "scale"
        elif key.endswith("_scale_inv") and key[: -len("_scale_inv")] in sd:
            key = key[: -len("_inv")]
        out[key] = t
    return out


def to_hf_names(
    state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16,
    keep_quantized: bool = False, consume: bool = False,
) -> dict[str, torch.Tensor]:
    """A DeepSeek-layout state dict (``model.`` prefix optional; FP8/FP4 payloads allowed) as the
    transformers-named dict :class:`DeepseekV4Model` loads. MTP layers are dropped. Without
    ``keep_quantized`` every scaled payload is dequantized to ``dtype`` here. ``consume``
    (``state_dict`` a dict the caller gives up): per-expert tensors are removed from it as they
    are stacked, so a layer's experts exist twice only while that layer is stacked, not the
    whole model's."""
    sd = {k.removeprefix("model."): v for k, v in state_dict.items() if not k.startswith(("mtp.", "model.mtp."))}
    if not keep_quantized:
        sd = dequantize_hf(sd, dtype)
    if consume and isinstance(state_dict, dict):
        for k in [k for k in state_dict if ".experts." in k]:
            del state_dict[k]  # the references in ``sd`` / ``experts`` below are the last ones
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str, str], dict[int, torch.Tensor]] = {}
    for key in list(sd):
        t = sd.pop(key)
        if key in _TOP_RENAMES:
            out[_TOP_RENAMES[key]] = t
            continue
        m = _LAYER.match(key)
        if m is None:
            raise CheckpointError(f"deepseek_v4: unknown tensor {key!r} in a DeepSeek-layout checkpoint")
        layer, rest = int(m.group(1)), m.group(2)
        e = _EXPERT.match(rest)
        if e is not None:
            experts.setdefault((layer, e.group(2), e.group(3)), {})[int(e.group(1))] = t
            continue
        out[f"model.layers.{layer}.{_rename_layer_rest(rest)}"] = t
    for layer, leaf in sorted({(lay, leaf) for lay, _, leaf in experts}):
        stacks = {}
        for w in ("w1", "w2", "w3"):
            per = experts.get((layer, w, leaf), {})
            if sorted(per) != list(range(len(per))) or not per:
                raise CheckpointError(f"deepseek_v4: layer {layer} experts' {w}.{leaf} are missing or not 0..E-1")
            stacks[w] = torch.stack([per[i] for i in range(len(per))])
            per.clear()  # drop the per-expert tensors as soon as they are stacked
        p = f"model.layers.{layer}.mlp.experts."
        suffix = "" if leaf == "weight" else "_scale"
        out[p + "gate_up_proj" + suffix] = torch.cat([stacks["w1"], stacks["w3"]], dim=1)
        out[p + "down_proj" + suffix] = stacks["w2"]
    return out
