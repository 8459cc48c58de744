"""Checkpoint layouts: what transformers' save_pretrained writes for DeepSeek-V4 (DeepSeek's own
names), the bare V4-Flash naming (``embed.weight``, ``layers.N...``) that transformers reads, and
FP8 / FP4 payloads dequantized exactly as transformers' Fp8Dequantize does."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.checkpoint import load_checkpoint
from engine.errors import CheckpointError
from engine.models.deepseek_v4 import DeepseekV4Config, DeepseekV4KVPool, DeepseekV4Model
from engine.models.deepseek_v4.weights.checkpoint_layout import (
    dequantize_block,
    is_deepseek_layout,
    to_hf_names,
)

_V4_FLASH_TOP = {"model.embed_tokens.weight": "embed.weight", "model.hc_head.hc_fn": "hc_head_fn",
                 "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale",
                 "model.norm.weight": "norm.weight"}


def _saved(model: torch.nn.Module, path: Path) -> dict[str, torch.Tensor]:
    model.save_pretrained(path)
    return load_file(path / "model.safetensors")


def test_save_pretrained_layout_converts_to_model_names(v4_builder: Callable[..., Any], tmp_path: Path) -> None:
    model, _ = v4_builder("csa-hca-csa-s_hc3_topk_all")
    sd = _saved(model, tmp_path)
    assert is_deepseek_layout(sd) and "model.layers.0.attn.wq_a.weight" in sd
    got = to_hf_names(sd, torch.float32)
    ref = model.state_dict()
    assert set(got) == set(ref)
    for k, v in ref.items():
        assert torch.equal(got[k], v), k


def test_bare_v4_flash_names_read_like_transformers(v4_builder: Callable[..., Any], tmp_path: Path) -> None:
    """Files named as the V4-Flash release names them (no ``model.``, ``embed``/``head``...):
    transformers' own from_pretrained and our conversion give the same tensors."""
    from transformers import DeepseekV4ForCausalLM

    model, _ = v4_builder("s-csa-hca_yarn_hc2")
    sd = _saved(model, tmp_path / "hf")
    bare = {}
    for k, v in sd.items():
        k = _V4_FLASH_TOP.get(k, k)
        bare[k.removeprefix("model.")] = v.contiguous()
    assert "embed.weight" in bare and "head.weight" in bare and "layers.1.attn.compressor.ape" in bare
    folder = tmp_path / "bare"
    folder.mkdir()
    (folder / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    save_file(bare, folder / "model.safetensors", metadata={"format": "pt"})
    theirs = DeepseekV4ForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    ours = to_hf_names(bare, torch.float32)
    assert set(ours) == set(theirs)
    for k, v in theirs.items():
        assert torch.equal(ours[k], v), k


def test_engine_loader_to_model_matches_transformers(v4_builder: Callable[..., Any], tmp_path: Path) -> None:
    """engine.checkpoint.load_checkpoint on a save_pretrained folder -> our model: same logits."""
    model, _ = v4_builder("legacy_fields_hc1_csa8")
    model.save_pretrained(tmp_path)
    ck = load_checkpoint(tmp_path, torch.float32, progress=False)
    cfg = DeepseekV4Config.from_hf_dict(ck.config.hf_config)
    ours = DeepseekV4Model.from_state_dict(cfg, ck.state_dict, dtype=torch.float32)
    ids = torch.randint(2, 97, (27,), generator=torch.Generator().manual_seed(5))
    cache = DeepseekV4KVPool.for_slots(cfg, 1, 32, torch.float32, "cpu")
    got = ours.compute_logits(ours(ids, torch.arange(27), [0, 27], [0], cache))
    with torch.no_grad():
        want = model(ids[None]).logits[0]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def _fp8_block_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    r, c = w.shape
    blocks = w.reshape(r // block[0], block[0], c // block[1], block[1])
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0
    q = (blocks / scale[:, None, :, None]).reshape(r, c).to(torch.float8_e4m3fn)
    return q, scale.float()


@pytest.mark.parametrize("scale_kind", ["fp32", "e8m0_uint8"])
def test_fp8_and_fp4_dequantize_like_transformers(scale_kind: str) -> None:
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    ref = Fp8Dequantize(None)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 40, generator=g)
    q, scale = _fp8_block_quantize(w, (16, 8))
    if scale_kind == "e8m0_uint8":
        scale = (torch.log2(scale).round() + 127).to(torch.uint8)
    got = dequantize_block(q, scale, torch.float32)
    torch.testing.assert_close(got, ref._dequantize_one(q, scale, output_dtype=torch.float32), atol=0, rtol=0)
    if scale_kind == "fp32":
        assert (got - w).abs().max() < 0.07 * w.abs().max()  # e4m3 keeps ~2 significant digits
    packed = torch.randint(-128, 128, (2, 12, 16), dtype=torch.int8, generator=g)  # experts x rows x K/2
    fp4_scale = torch.rand(2, 12, 1, generator=g) + 0.5  # one scale per 32 columns
    got4 = dequantize_block(packed, fp4_scale, torch.float32)
    want4 = torch.stack([ref._dequantize_one(packed[e], fp4_scale[e], output_dtype=torch.float32) for e in range(2)])
    torch.testing.assert_close(got4, want4, atol=0, rtol=0)


def test_quantized_deepseek_layout_loads(v4_builder: Callable[..., Any], tmp_path: Path) -> None:
    """FP8 linears with a ``.scale`` sibling (V4-Flash naming): kept as stored by default (never
    silently upcast), their dequantized values with ``weight_format=dequantize``."""
    model, raw = v4_builder("s-csa-hca_yarn_hc2")
    sd = _saved(model, tmp_path)
    key = "model.layers.1.attn.wq_b.weight"
    q, scale = _fp8_block_quantize(sd[key], (16, 8))
    sd[key], sd[key.replace(".weight", ".scale")] = q, scale
    cfg = DeepseekV4Config.from_hf_dict(raw)
    kept = DeepseekV4Model.from_state_dict(cfg, sd, dtype=torch.float32).model.layers[1].self_attn.q_b_proj
    assert kept.weight.dtype == torch.float8_e4m3fn and torch.equal(kept.weight.view(torch.uint8), q.view(torch.uint8))
    assert kept.block == (16, 8) and torch.equal(kept.scale, scale)
    ours = DeepseekV4Model.from_state_dict(cfg, sd, dtype=torch.float32, weight_format="dequantize")
    want = dequantize_block(q, scale, torch.float32)
    assert torch.equal(ours.model.layers[1].self_attn.q_b_proj.weight, want)
    del sd["model.layers.0.ffn.experts.1.w2.weight"]
    with pytest.raises(CheckpointError, match="experts"):
        DeepseekV4Model.from_state_dict(cfg, sd)
