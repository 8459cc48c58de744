"""engine/checkpoint.py on tiny random HF checkpoints written by transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.checkpoint import load_checkpoint, load_model_config
from engine.errors import CheckpointError


def _reference_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.state_dict()


@pytest.mark.parametrize(
    ("family", "sharded", "tied"),
    [
        ("llama", False, False),
        ("llama", True, True),
        ("qwen2", True, False),
        ("qwen3", False, True),
    ],
)
def test_every_tensor_equals_transformers(make_tiny_checkpoint, family, sharded, tied):
    folder = make_tiny_checkpoint(family, sharded=sharded, tie_word_embeddings=tied)
    assert (folder / "model.safetensors.index.json").is_file() == sharded
    if sharded:
        assert len(list(folder.glob("model-*-of-*.safetensors"))) > 2

    ckpt = load_checkpoint(folder, torch.float32, progress=False)
    ref = _reference_state_dict(folder)

    expected_names = set(ref) - ({"lm_head.weight"} if tied else set())
    assert set(ckpt.state_dict) == expected_names
    for name, tensor in ckpt.state_dict.items():
        assert tensor.dtype == torch.float32
        torch.testing.assert_close(tensor, ref[name], rtol=0, atol=0, msg=name)
    assert ckpt.config.family == family
    assert ckpt.config.tie_word_embeddings == tied
    assert ckpt.source == folder


def test_config_fields(make_tiny_checkpoint):
    llama = load_model_config(make_tiny_checkpoint("llama"))
    assert llama.rope.rope_type == "llama3"
    assert llama.rope.factor == 8.0
    assert llama.rope.original_max_position_embeddings == 64
    assert (llama.num_heads, llama.num_kv_heads, llama.head_dim) == (4, 2, 16)
    qwen3 = load_model_config(make_tiny_checkpoint("qwen3"))
    assert qwen3.head_dim == 24 and qwen3.qk_norm and not qwen3.attention_bias
    qwen2_folder = make_tiny_checkpoint("qwen2")
    qwen2 = load_model_config(qwen2_folder)
    assert qwen2.attention_bias and not qwen2.qk_norm
    assert load_model_config(qwen2_folder / "config.json") == qwen2


def test_dtype_cast_and_fingerprint(make_tiny_checkpoint):
    folder = make_tiny_checkpoint("qwen3")
    bf16 = load_checkpoint(folder, torch.bfloat16, progress=False)
    fp32 = load_checkpoint(folder, torch.float32, progress=False)
    assert all(t.dtype == torch.bfloat16 for t in bf16.state_dict.values())
    name = "model.layers.1.mlp.down_proj.weight"
    torch.testing.assert_close(bf16.state_dict[name], fp32.state_dict[name].to(torch.bfloat16))
    # Same shapes -> same fingerprint (weights do not enter it); other shapes -> another one.
    assert bf16.model_fingerprint == fp32.model_fingerprint
    other = load_checkpoint(
        make_tiny_checkpoint("qwen3", seed=1, num_hidden_layers=3), torch.float32, progress=False
    )
    assert other.model_fingerprint != fp32.model_fingerprint
    assert len(fp32.model_fingerprint) == 64


def test_generation_config_eos_folds_in(make_tiny_checkpoint):
    folder = make_tiny_checkpoint("llama")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9]}))
    assert load_model_config(folder).eos_token_ids == (2, 7, 9)


def test_progress_bar_goes_to_stderr(make_tiny_checkpoint, capsys):
    load_checkpoint(make_tiny_checkpoint("qwen2"), torch.float32, progress=True)
    captured = capsys.readouterr()
    assert "loading" in captured.err and "tensor" in captured.err
    assert captured.out == ""


def _rewrite_single_file(folder: Path, edit) -> Path:
    file = folder / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})
    return file


def test_missing_tensor_names_file_and_tensor(make_tiny_checkpoint):
    folder = make_tiny_checkpoint("qwen2")
    name = "model.layers.1.self_attn.k_proj.bias"
    _rewrite_single_file(folder, lambda t: t.pop(name))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(folder, torch.float32, progress=False)
    assert name in str(e.value) and "model.safetensors" in str(e.value)
    assert "missing" in str(e.value)


def test_wrong_shape_names_file_and_tensor(make_tiny_checkpoint):
    folder = make_tiny_checkpoint("llama")
    name = "model.layers.0.self_attn.v_proj.weight"

    def edit(t: dict[str, torch.Tensor]) -> None:
        t[name] = torch.zeros(40, 64)

    file = _rewrite_single_file(folder, edit)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(folder, torch.float32, progress=False)
    msg = str(e.value)
    assert name in msg and str(file) in msg and "[40, 64]" in msg and "[32, 64]" in msg


def test_missing_shard_tensor_names_the_shard(make_tiny_checkpoint):
    folder = make_tiny_checkpoint("qwen3", sharded=True)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    name = "model.layers.1.self_attn.q_norm.weight"
    shard = folder / index["weight_map"][name]
    tensors = load_file(shard)
    tensors.pop(name)
    tensors["model.layers.1.self_attn.q_norm.unused"] = torch.zeros(1)  # keep the file non-empty
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(folder, torch.float32, progress=False)
    assert name in str(e.value) and shard.name in str(e.value)


def test_unexpected_tensor_is_refused(make_tiny_checkpoint):
    folder = make_tiny_checkpoint("llama")
    name = "model.layers.0.mlp.gate_proj.bias"
    _rewrite_single_file(folder, lambda t: t.__setitem__(name, torch.zeros(88)))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.gate"):
        load_checkpoint(folder, torch.float32, progress=False)


def test_unknown_architecture_names_config_file(make_tiny_checkpoint):
    folder = make_tiny_checkpoint("llama")
    config = json.loads((folder / "config.json").read_text())
    config["model_type"], config["architectures"] = "mamba", ["MambaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as e:
        load_model_config(folder)
    assert "mamba" in str(e.value) and "config.json" in str(e.value)


def test_unreadable_files(tmp_path, make_tiny_checkpoint):
    folder = make_tiny_checkpoint("llama")
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint(folder, torch.float32, progress=False)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model_config(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="neither config.json nor a .gguf"):
        load_model_config(empty)
    bad_json = tmp_path / "bad"
    shutil.copytree(folder, bad_json)
    (bad_json / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json"):
        load_model_config(bad_json)
    garbage = tmp_path / "x.gguf"
    garbage.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(CheckpointError, match="x.gguf"):
        load_model_config(garbage)


def test_deepseek_v4_loads_all_tensors_by_name(tmp_path):
    folder = tmp_path / "dsv4"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "deepseek_v4",
                "vocab_size": 32,
                "hidden_size": 16,
                "moe_intermediate_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 8,
            }
        )
    )
    tensors = {
        "model.embed_tokens.weight": torch.randn(32, 16, dtype=torch.bfloat16),
        "model.layers.0.ffn.experts.0.w1.weight": torch.randn(8, 16).to(torch.float8_e4m3fn),
        "model.layers.0.ffn.experts.0.w1.scale": torch.rand(1, 1),
    }
    save_file(tensors, folder / "model.safetensors")
    ckpt = load_checkpoint(folder, torch.float32, progress=False)
    assert set(ckpt.state_dict) == set(tensors)
    assert ckpt.state_dict["model.embed_tokens.weight"].dtype == torch.float32
    # fp8 payloads stay as stored: their meaning needs the scales.
    w1 = ckpt.state_dict["model.layers.0.ffn.experts.0.w1.weight"]
    assert w1.dtype == torch.float8_e4m3fn
    assert torch.equal(
        w1.view(torch.uint8), tensors["model.layers.0.ffn.experts.0.w1.weight"].view(torch.uint8)
    )


def test_weights_do_not_alias_the_file(make_tiny_checkpoint):
    """safetensors hands out memory-mapped views; the loader must own its weights."""
    from safetensors.torch import save

    folder = make_tiny_checkpoint("llama")
    ckpt = load_checkpoint(folder, torch.float32, progress=False)
    before = {k: v.clone() for k, v in ckpt.state_dict.items()}
    file = folder / "model.safetensors"
    zeros = save({k: torch.zeros_like(v) for k, v in load_file(file).items()})
    with open(file, "r+b") as f:  # rewrite in place (same inode): a mapped view would change
        f.write(zeros)
    for name, tensor in ckpt.state_dict.items():
        assert torch.equal(tensor, before[name]), name
