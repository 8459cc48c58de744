"""engine/gguf_loader.py: the default SmolLM2 GGUF read by us equals transformers' reading of it,
and the q/k un-permutation is the exact inverse of llama.cpp's permutation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine.checkpoint import load_checkpoint, load_model_config
from engine.errors import CheckpointError
from engine.gguf_loader import unpermute_rows


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py, LlamaModel.permute
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@pytest.mark.parametrize(("n_head", "head_dim", "cols"), [(3, 64, 5), (9, 6, 1), (2, 4, 7)])
def test_unpermute_inverts_llama_cpp_permute(n_head, head_dim, cols):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n_head * head_dim, cols)).astype(np.float32)
    permuted = _llama_cpp_permute(w, n_head)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_rows(permuted, n_head), w)
    bias = w[:, 0].copy()
    np.testing.assert_array_equal(unpermute_rows(_llama_cpp_permute(bias, n_head), n_head), bias)


def test_smollm2_config(smollm2_gguf: Path):
    cfg = load_model_config(smollm2_gguf)
    assert (cfg.family, cfg.num_layers, cfg.hidden_size) == ("llama", 30, 576)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (9, 3, 64)
    assert (cfg.intermediate_size, cfg.vocab_size) == (1536, 49152)
    assert cfg.max_position_embeddings == 8192
    assert cfg.rope.theta == 100000.0 and cfg.rope.rope_type == "default"
    assert cfg.tie_word_embeddings
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    # A folder holding exactly one .gguf resolves to it.
    assert load_model_config(smollm2_gguf.parent) == cfg


def test_smollm2_tensors_equal_transformers(smollm2_gguf, smollm2_transformers_state_dict):
    ref = smollm2_transformers_state_dict
    ckpt = load_checkpoint(smollm2_gguf, torch.float32, progress=False)
    assert set(ckpt.state_dict) == set(ref) - {"lm_head.weight"}
    names = [
        "model.embed_tokens.weight",  # Q8_0
        "model.layers.0.self_attn.q_proj.weight",  # Q4_1, un-permuted (9 heads)
        "model.layers.0.self_attn.k_proj.weight",  # Q4_1, un-permuted (3 kv heads)
        "model.layers.17.self_attn.k_proj.weight",
        "model.layers.29.self_attn.q_proj.weight",
        "model.layers.3.self_attn.v_proj.weight",
        "model.layers.5.self_attn.o_proj.weight",
        "model.layers.7.mlp.down_proj.weight",
        "model.layers.29.mlp.gate_proj.weight",
        "model.layers.11.input_layernorm.weight",  # F32
        "model.norm.weight",
    ]
    for name in names:
        torch.testing.assert_close(ckpt.state_dict[name], ref[name], rtol=0, atol=0, msg=name)
    for name, tensor in ckpt.state_dict.items():
        assert tuple(tensor.shape) == tuple(ref[name].shape), name
    # Without the un-permutation q would differ: the test above is not vacuous.
    q = ckpt.state_dict["model.layers.0.self_attn.q_proj.weight"].numpy()
    assert not np.array_equal(
        _llama_cpp_permute(q, 9), ref["model.layers.0.self_attn.q_proj.weight"].numpy()
    )


def test_gguf_folder_with_two_files_is_ambiguous(tmp_path, smollm2_gguf):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).symlink_to(smollm2_gguf)
    with pytest.raises(CheckpointError, match="several .gguf"):
        load_model_config(tmp_path)


def test_truncated_gguf_names_file_and_tensor(tmp_path, smollm2_gguf):
    cut = tmp_path / "cut.gguf"
    with open(smollm2_gguf, "rb") as src:
        cut.write_bytes(src.read(60_000_000))
    with pytest.raises(CheckpointError, match=r"cut\.gguf: tensor 'blk\.\d+\.\w+\.weight' ends at"):
        load_model_config(cut)
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(cut, torch.float32, progress=False)
