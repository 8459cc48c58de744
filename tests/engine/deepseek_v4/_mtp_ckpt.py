"""A tiny DeepSeek-V4 checkpoint WITH MTP layers, in DeepSeek's layout (``mtp.{i}.*``), and a
plain reference of one MTP layer's forward built on transformers' own V4 layer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tests.engine.deepseek_v4.conftest import _BASE, build_hf_v4


def mtp_aux_config(raw: dict[str, Any]) -> dict[str, Any]:
    """One sliding layer with a routed MoE: the shape of an MTP layer's block."""
    out = {k: v for k, v in raw.items() if k not in ("compress_ratios", "num_hash_layers",
                                                     "compress_rate_csa", "compress_rate_hca")}
    out.update(num_hidden_layers=1, layer_types=["sliding_attention"], mlp_layer_types=["moe"])
    return out


def build_mtp_aux(raw: dict[str, Any], main: torch.nn.Module, seed: int) -> torch.nn.Module:
    """transformers model whose layer 0, norm and hc head are the MTP layer's and whose
    embedding and head are ``main``'s (shared, as in the checkpoint)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    aux = DeepseekV4ForCausalLM(DeepseekV4Config(**mtp_aux_config(raw))).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in aux.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.3 if "sinks" in name or "bias" in name else 0.05))
        for name, b in aux.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
        aux.model.embed_tokens.weight.copy_(main.model.embed_tokens.weight)
        aux.lm_head.weight.copy_(main.lm_head.weight)
    return aux


def mtp_glue(d: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"e_proj.weight": torch.randn(d, d, generator=g) * d ** -0.5,
            "h_proj.weight": torch.randn(d, d, generator=g) * d ** -0.5,
            "enorm.weight": 1 + 0.1 * torch.randn(d, generator=g),
            "hnorm.weight": 1 + 0.1 * torch.randn(d, generator=g)}


def write_v4_with_mtp(name: str, folder: Path, num_mtp: int = 1, seed: int = 0
                      ) -> tuple[torch.nn.Module, list[torch.nn.Module], list[dict[str, torch.Tensor]]]:
    """save_pretrained of the tiny model ``name`` plus ``num_mtp`` MTP layers as
    ``mtp.{i}.*`` tensors; -> (main model, each layer's aux model, each layer's glue)."""
    main, raw = build_hf_v4(name, seed)
    main.save_pretrained(folder)
    sd = load_file(folder / "model.safetensors")
    auxes, glues = [], []
    for i in range(num_mtp):
        aux = build_mtp_aux(raw, main, seed=100 + i)
        glue = mtp_glue(_BASE["hidden_size"], seed=200 + i)
        aux.save_pretrained(folder / f"aux{i}")
        asd = load_file(folder / f"aux{i}" / "model.safetensors")
        for k, v in asd.items():
            if k.startswith("model.layers.0."):
                sd[f"mtp.{i}." + k.removeprefix("model.layers.0.")] = v
        sd[f"mtp.{i}.norm.weight"] = asd["model.norm.weight"]
        for leaf in ("fn", "base", "scale"):
            sd[f"mtp.{i}.hc_head_{leaf}"] = asd[f"model.hc_head.hc_{leaf}"]
        for k, v in glue.items():
            sd[f"mtp.{i}.{k}"] = v
        auxes.append(aux)
        glues.append(glue)
    save_file({k: v.contiguous() for k, v in sd.items()}, folder / "model.safetensors",
              metadata={"format": "pt"})
    import json

    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = num_mtp
    (folder / "config.json").write_text(json.dumps(cfg))
    return main, auxes, glues


def main_streams(main: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """[S, hc, d]: transformers' main model's residual streams before its mHC head."""
    got: list[torch.Tensor] = []
    hook = main.model.hc_head.register_forward_pre_hook(lambda _m, args: got.append(args[0]))
    with torch.no_grad():
        main(ids[None])
    hook.remove()
    return got[0][0]


def reference_mtp_logits(aux: torch.nn.Module, glue: dict[str, torch.Tensor], h: torch.Tensor,
                         next_ids: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP layer by its definition: x = h_proj(hnorm(h)) + e_proj(enorm(embed(next))) fed
    to transformers' layer in place of its embedding streams, then its hc head, norm and the
    shared head. h: [S, hc, d], next_ids: [S] -> (logits [S, vocab], output streams [S, hc, d])."""

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    e = aux.model.embed_tokens(next_ids)
    x = rms(h, glue["hnorm.weight"]) @ glue["h_proj.weight"].t() \
        + (rms(e, glue["enorm.weight"]) @ glue["e_proj.weight"].t()).unsqueeze(1)
    out: list[torch.Tensor] = []
    pre = aux.model.layers[0].register_forward_pre_hook(
        lambda _m, args, kwargs: ((x[None].to(args[0].dtype), *args[1:]), kwargs), with_kwargs=True)
    post = aux.model.layers[0].register_forward_hook(lambda _m, _a, o: out.append(o))
    with torch.no_grad():
        logits = aux(next_ids[None]).logits[0]
    pre.remove()
    post.remove()
    return logits, out[0][0]
