"""GGUF files for tiny random Llama, Qwen2 and Qwen3 models, written here the way llama.cpp's
convert_hf_to_gguf.py writes them (llama q/k rows permuted, Q8_0/Q4_1/F16/BF16 weights, F32 norms
and biases), then read by our loader and by transformers: both must agree exactly, and both must be
the original weights up to quantization error."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine.checkpoint import load_checkpoint, load_model_config
from engine.errors import CheckpointError
from tests.engine.conftest import build_tiny_model

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _gguf_name(hf: str) -> str:
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py, LlamaModel.permute
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _write_gguf(
    model: torch.nn.Module, family: str, path: Path, extra: dict[str, np.ndarray] | None = None
) -> None:
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch=family)
    writer.add_name(f"tiny-{family}")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for i, (name, tensor) in enumerate(model.state_dict().items()):
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = tensor.float().numpy()
        if family == "llama" and ".q_proj." in name:
            w = _permute(w, cfg.num_attention_heads)
        elif family == "llama" and ".k_proj." in name:
            w = _permute(w, cfg.num_key_value_heads)
        if w.ndim == 2 and w.shape[1] % 32:  # rows must be whole quant blocks: F16 or BF16
            if ".layers.0." in name:
                writer.add_tensor(_gguf_name(name), w.astype(np.float16))
            else:
                bf16 = gguf.quants.quantize(w, Q.BF16)
                writer.add_tensor(_gguf_name(name), bf16, raw_dtype=Q.BF16)
        elif w.ndim == 2:
            qtype = Q.Q4_1 if i % 3 == 0 else Q.Q8_0
            writer.add_tensor(_gguf_name(name), gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(_gguf_name(name), np.ascontiguousarray(w, dtype=np.float32))
    for name, array in (extra or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _transformers_tensors(path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    return load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]


@pytest.mark.parametrize(
    ("family", "tied"), [("llama", True), ("llama", False), ("qwen2", False), ("qwen3", True)]
)
def test_tiny_gguf_equals_transformers_and_original(tmp_path, family, tied):
    overrides: dict = {"tie_word_embeddings": tied}
    if family == "llama":  # llama3 scaling lives in a rope_freqs tensor in GGUF: not this test
        overrides["rope_parameters"] = {"rope_type": "default", "rope_theta": 50000.0}
    if family == "qwen3":  # transformers reads no head_dim from a qwen3 GGUF: keep the default
        overrides["head_dim"] = 16
    model = build_tiny_model(family, **overrides)
    path = tmp_path / f"tiny-{family}.gguf"
    _write_gguf(model, family, path)

    ours = load_checkpoint(path, torch.float32, progress=False)
    theirs = _transformers_tensors(path)
    original = model.state_dict()

    assert set(ours.state_dict) == set(original) - ({"lm_head.weight"} if tied else set())
    for name, tensor in ours.state_dict.items():
        torch.testing.assert_close(tensor, theirs[name], rtol=0, atol=0, msg=name)
        # Q4_1 error is a fraction of a weight's scale; a row permutation would be O(1).
        err = (tensor - original[name]).abs().max().item()
        assert err <= 0.1 * original[name].abs().max().item() + 1e-6, (name, err)

    cfg, hf_cfg = ours.config, load_model_config(_save(model, tmp_path))
    for field in ("family", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
                  "num_heads", "num_kv_heads", "head_dim", "tie_word_embeddings",
                  "attention_bias", "qk_norm", "max_position_embeddings"):  # fmt: skip
        assert getattr(cfg, field) == getattr(hf_cfg, field), field
    assert cfg.rope.theta == hf_cfg.rope.theta
    assert cfg.rms_norm_eps == pytest.approx(hf_cfg.rms_norm_eps)
    assert cfg.name == f"tiny-{family}"


def _save(model: torch.nn.Module, tmp_path: Path) -> Path:
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    return folder


def test_unknown_architecture_and_tensor_name_the_file(tmp_path):
    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), arch="mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match=r"mamba\.gguf: unknown architecture 'mamba'"):
        load_model_config(path)

    model = build_tiny_model("qwen2")
    path = tmp_path / "extra.gguf"
    _write_gguf(model, "qwen2", path, extra={"blk.0.ssm_conv1d.weight": np.zeros(4, np.float32)})
    with pytest.raises(
        CheckpointError, match=r"extra\.gguf: unexpected tensor 'blk\.0\.ssm_conv1d"
    ):
        load_checkpoint(path, torch.float32, progress=False)
