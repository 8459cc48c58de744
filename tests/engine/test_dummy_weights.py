"""``load_format=dummy``: random weights with the checkpoint's names, shapes and storage formats,
made from config.json alone, the same for the same seed; the one-box arena filled from them a
few tensors at a time (engine/weight_share.py ``pack_stream``) holds exactly what ``pack`` of
the whole dict holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.checkpoint import load_checkpoint
from engine.errors import CheckpointError
from engine.model_config import ModelConfig
from engine.models.dense_family import expected_tensor_shapes
from engine.models.family import family_class
from engine.weight_share import pack, pack_stream
from lab.bench.deepseek_v4.write_checkpoint import flash_hf_config

DATA = Path(__file__).resolve().parents[1] / "data"
CPU = torch.device("cpu")


def _dense() -> ModelConfig:
    d = json.loads((DATA / "qwen3-8b-config.json").read_text())
    d.update(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=300)
    return ModelConfig.from_hf_dict(d, name="tiny-qwen3")


def _v4(quantized: bool = True) -> ModelConfig:
    hf = flash_hf_config(3, 4, hidden=256, vocab=512)
    if not quantized:
        hf.pop("quantization_config")
        hf.pop("expert_dtype")
    return ModelConfig.from_hf_dict(hf, name="tiny-v4")


def _dummy(cfg: ModelConfig, seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
    return dict(family_class(cfg).dummy_tensors(cfg, torch.float32, torch.device(device), seed))


def test_dense_dummy_has_the_checkpoint_tensors_and_init_spread() -> None:
    cfg = _dense()
    sd = _dummy(cfg)
    assert {n: tuple(t.shape) for n, t in sd.items()} == expected_tensor_shapes(cfg)
    assert all(t.dtype == torch.float32 for t in sd.values())
    assert torch.all(sd["model.norm.weight"] == 1)
    w = sd["model.layers.0.mlp.up_proj.weight"]
    assert 0.015 < w.std().item() < 0.025 and abs(w.mean().item()) < 0.005


def test_dummy_weights_are_the_same_for_a_seed_and_differ_across_seeds() -> None:
    for cfg in (_dense(), _v4()):
        a, b, c = _dummy(cfg, 3), _dummy(cfg, 3), _dummy(cfg, 4)
        assert a.keys() == b.keys() == c.keys()
        assert all(torch.equal(a[n].view(torch.uint8) if a[n].element_size() == 1 else a[n],
                               b[n].view(torch.uint8) if b[n].element_size() == 1 else b[n])
                   for n in a)
        name = next(n for n in a if n.endswith(("gate_up_proj", "mlp.up_proj.weight")))
        assert not torch.equal(a[name].view(torch.uint8), c[name].view(torch.uint8))


def test_v4_dummy_stores_what_the_config_declares() -> None:
    quant = _dummy(_v4(quantized=True))
    fp8 = [n for n, t in quant.items() if t.dtype == torch.float8_e4m3fn]
    assert fp8 and all(n + "_scale" in quant or n.replace(".weight", ".scale") in quant
                       or n[: -len("weight")] + "scale" in quant for n in fp8)
    experts = [t for n, t in quant.items() if n.endswith("experts.gate_up_proj")]
    assert experts and all(t.dtype == torch.int8 for t in experts)  # packed e2m1 pairs
    plain = _dummy(_v4(quantized=False))
    assert not any(t.dtype in (torch.float8_e4m3fn, torch.int8) for t in plain.values())


def test_a_quantization_the_family_cannot_hold_is_refused() -> None:
    hf = flash_hf_config(3, 4, hidden=256, vocab=512)
    hf["quantization_config"] = {"quant_method": "awq", "bits": 4}
    with pytest.raises(CheckpointError, match="quant_method='awq'"):
        _dummy(ModelConfig.from_hf_dict(hf))
    d = json.loads((DATA / "qwen3-8b-config.json").read_text())
    d["quantization_config"] = {"quant_method": "gptq"}
    with pytest.raises(CheckpointError, match="quant_method='gptq'"):
        _dummy(ModelConfig.from_hf_dict(d))


@pytest.mark.parametrize("cfg", [_dense(), _v4()], ids=["dense", "v4"])
def test_meta_pass_lays_out_what_the_real_pass_makes(cfg: ModelConfig) -> None:
    meta = _dummy(cfg, device="meta")
    real = _dummy(cfg)
    assert {n: (tuple(t.shape), t.dtype) for n, t in meta.items()} == \
        {n: (tuple(t.shape), t.dtype) for n, t in real.items()}


@pytest.mark.parametrize("cfg", [_dense(), _v4()], ids=["dense", "v4"])
def test_streamed_arena_equals_the_packed_one(cfg: ModelConfig) -> None:
    family = family_class(cfg)
    streamed = pack_stream(_dummy(cfg, device="meta"),
                           family.dummy_tensors(cfg, torch.float32, CPU, 5), CPU)
    whole = pack(_dummy(cfg, 5), CPU)
    assert streamed.entries == whole.entries
    got, want = streamed.tensors(), whole.tensors()  # padding between entries is not compared
    assert got.keys() == want.keys()
    assert all(torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8)) for n in got)


def test_a_config_only_folder_loads_as_dummy(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_v4().hf_config))
    with pytest.raises(CheckpointError):  # no weights: the real loader refuses
        load_checkpoint(tmp_path, torch.float32)
    a = load_checkpoint(tmp_path, torch.float32, load_format="dummy", seed=1)
    b = load_checkpoint(tmp_path, torch.float32, load_format="dummy", seed=2)
    assert a.state_dict.keys() == b.state_dict.keys()
    assert a.model_fingerprint != b.model_fingerprint  # KV of other weights never mixes
