"""The synthetic V4-Flash checkpoint writer: a small one written by the script itself is a folder
the engine's real loader serves (greedy tokens, FP8 / MXFP4 kept as stored), in the shipped
on-disk layout (index covering every tensor, shards under the bound, dtypes as shipped); and the
tensor spec at V4-Flash's dimensions (43 layers x 128 experts) is exactly what the memory plan
counts for the weights, without writing anything."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from engine.models.deepseek_v4.config import CSA, HCA, SLIDING, DeepseekV4Config
from engine.models.deepseek_v4.weights.checkpoint_specs import checkpoint_specs
from lab.bench.deepseek_v4.write_checkpoint import INDEX_FILE, flash_hf_config

LAYERS, EXPERTS, HIDDEN, VOCAB = 4, 8, 256, 49152
SHARD_MB = 26  # the embedding (49152 x 256 bf16 = 24 MiB) fits; the model needs several shards
REPO = Path(__file__).resolve().parents[3]


def _script(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "LMCACHE_TRACK_USAGE": "false"}
    return subprocess.run([sys.executable, "-m", "lab.bench.deepseek_v4.write_checkpoint", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("v4flash") / "ckpt"
    run = _script(str(out), "--layers", str(LAYERS), "--experts", str(EXPERTS), "--hidden", str(HIDDEN),
                  "--vocab", str(VOCAB), "--max-shard-mb", str(SHARD_MB))
    assert run.returncode == 0, run.stderr[-3000:]
    return out


def _header(path: Path) -> dict[str, dict]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def test_index_covers_every_tensor_and_shards_respect_the_bound(folder: Path) -> None:
    index = json.loads((folder / INDEX_FILE).read_text())
    weight_map = index["weight_map"]
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 1 and {p.name for p in shards} == set(weight_map.values())
    assert [p.name for p in shards] == [f"model-{k:05d}-of-{len(shards):05d}.safetensors"
                                        for k in range(1, len(shards) + 1)]
    in_files: dict[str, str] = {}
    total = 0
    for p in shards:
        header = _header(p)
        data = sum(end - start for start, end in (h["data_offsets"] for h in header.values()))
        assert data <= SHARD_MB << 20, (p.name, data)
        total += data
        for name in header:
            assert name not in in_files, f"{name} in two shards"
            in_files[name] = p.name
    assert in_files == weight_map  # every tensor indexed, each where the index says
    assert index["metadata"]["total_size"] == total
    cfg = DeepseekV4Config.from_hf_dict(json.loads((folder / "config.json").read_text()))
    assert set(weight_map) == {s.name for s in checkpoint_specs(cfg)}


def test_layout_and_dtypes_are_as_shipped(folder: Path) -> None:
    """DeepSeek's own names and V4-Flash's dtypes, nothing upcast: F8_E4M3 projections with an
    F8_E8M0 grid per 128 x 128, I8-packed experts with an F8_E8M0 scale per 32, I64 hash
    tables on the first three layers only, F32 sinks and mHC, BF16 norms."""
    hf = json.loads((folder / "config.json").read_text())
    assert hf["compress_ratios"] == [0, 0, 4, 128] and hf["num_hash_layers"] == 3
    assert hf["quantization_config"]["scale_fmt"] == "ue8m0" and hf["expert_dtype"] == "fp4"
    cfg = DeepseekV4Config.from_hf_dict(hf)
    assert cfg.layer_types == (SLIDING, SLIDING, CSA, HCA)
    weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
    dtypes: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for shard in sorted(set(weight_map.values())):
        with safe_open(folder / shard, "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                t = f.get_tensor(name)
                dtypes[name] = (t.dtype, tuple(t.shape))
    h, inter = cfg.hidden_size, cfg.moe_intermediate_size
    assert dtypes["layers.0.attn.wq_a.weight"] == (torch.float8_e4m3fn, (cfg.q_lora_rank, h))
    assert dtypes["layers.0.attn.wq_a.scale"] == (torch.float8_e8m0fnu, (-(-cfg.q_lora_rank // 128), h // 128))
    assert dtypes["layers.2.attn.indexer.wq_b.weight"][0] == torch.float8_e4m3fn
    assert dtypes["layers.1.ffn.shared_experts.w2.weight"][0] == torch.float8_e4m3fn
    for w, (rows, cols) in (("w1", (inter, h)), ("w2", (h, inter)), ("w3", (inter, h))):
        assert dtypes[f"layers.3.ffn.experts.{EXPERTS - 1}.{w}.weight"] == (torch.int8, (rows, cols // 2))
        assert dtypes[f"layers.3.ffn.experts.{EXPERTS - 1}.{w}.scale"] == (torch.float8_e8m0fnu, (rows, cols // 32))
    assert sum(".ffn.experts." in n and n.endswith(".weight") for n in weight_map) == LAYERS * EXPERTS * 3
    assert [dtypes.get(f"layers.{i}.ffn.gate.tid2eid", (None,))[0] for i in range(LAYERS)] == [torch.int64] * 3 + [None]
    assert [f"layers.{i}.ffn.gate.bias" in weight_map for i in range(LAYERS)] == [False] * 3 + [True]
    assert "layers.3.attn.indexer.wq_b.weight" not in weight_map  # HCA layers have no indexer
    assert dtypes["layers.0.attn.attn_sink"][0] == torch.float32
    assert dtypes["layers.0.hc_attn_fn"][0] == torch.float32
    assert dtypes["layers.0.attn.kv_norm.weight"][0] == torch.bfloat16
    assert dtypes["embed.weight"] == (torch.bfloat16, (VOCAB, h))
    floats = {d for d, _ in dtypes.values() if d is not None and d.is_floating_point}
    assert floats == {torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.bfloat16, torch.float32}


def test_engine_loads_the_folder_and_decodes(folder: Path) -> None:
    """LLMEngine.from_config on the written folder: the projections and experts stay FP8 /
    MXFP4, the plan's weights term is what the model holds, and a chat prompt tokenized with
    the folder's tokenizer decodes greedily to the same tokens as the explicitly dequantized
    model (two different weight paths agreeing on the same file)."""
    from common.tokenizer import Tokenizer
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.models.deepseek_v4.weights.quant_modules import Fp8Linear, Mxfp4Experts
    from engine.sampling_params import SamplingParams

    tok = Tokenizer.from_path(folder)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Capital of France?"}],
                                             add_generation_prompt=True), add_special_tokens=False)
    got = {}
    for fmt in ("checkpoint", "dequantize"):
        # V4 KV blocks hold whole compressor windows: a multiple of the rates (4, 128)
        ec = EngineConfig(model=str(folder), device="cpu", dtype="float32", max_context=64,
                          chunk_tokens=16, max_batch=2, weight_format=fmt, block_size=128,
                          attn_tile_tokens=128)
        engine = LLMEngine.from_config(ec)
        v4 = engine.runner.model.model
        layer = v4.model.layers[2]
        kept = isinstance(layer.self_attn.q_b_proj, Fp8Linear) and isinstance(layer.mlp.experts, Mxfp4Experts)
        assert kept == (fmt == "checkpoint")
        held = sum(t.numel() * t.element_size() for n, t in v4.state_dict().items() if "rotary" not in n)
        assert engine.plan.term("weights") == held
        engine.add_request("q", ids, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
        got[fmt] = []
        while engine.has_unfinished():
            for o in engine.step():
                got[fmt] += o.new_token_ids
        del engine
    assert len(got["checkpoint"]) == 5 and all(0 <= t < VOCAB for t in got["checkpoint"])
    assert got["checkpoint"] == got["dequantize"]


def test_flash_spec_is_what_the_plan_counts() -> None:
    """43 layers x 128 experts at V4-Flash's widths, never written: the spec's bytes, as the
    model holds them, equal the plan's weight estimate from config.json alone; --dry-run prints
    the same total and a shard count."""
    from engine.models.deepseek_v4.weights.quant_weights import resident_weight_bytes
    from engine.models.deepseek_v4.weights.weight_bytes import deepseek_v4_weight_bytes

    hf = flash_hf_config(43, 128)
    cfg = DeepseekV4Config.from_hf_dict(hf)
    specs = list(checkpoint_specs(cfg))
    with torch.device("meta"):
        sd = {s.name: torch.empty(s.shape, dtype=s.dtype) for s in specs}
    # norms ship in bf16 but the model holds them in fp32 (2 more bytes a value)
    norm_values = sum(sd[s.name].numel() for s in specs if "norm" in s.name)
    held = resident_weight_bytes(sd, torch.bfloat16, "checkpoint") + 2 * norm_values
    planned = deepseek_v4_weight_bytes(cfg, torch.bfloat16, True, True, "checkpoint")
    assert held == planned
    assert 76 * 2**30 < planned < 78 * 2**30  # docs/deepseek_v4.md: 76.71 GiB
    stored = sum(s.nbytes for s in specs)
    assert sum(s.dtype == torch.int8 for s in specs) == 43 * 128 * 3
    run = _script("/nonexistent/never-written", "--layers", "43", "--experts", "128", "--dry-run")
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"{len(specs)} tensors, {stored} bytes" in run.stdout
    shards = int(run.stdout.split(" shards")[0].rsplit(" ", 1)[1])
    assert shards == -(-stored // (3500 << 20)) or shards == -(-stored // (3500 << 20)) + 1
    assert not Path("/nonexistent/never-written").exists()


def test_bad_arguments_are_refused_naming_the_flag(tmp_path: Path) -> None:
    run = _script(str(tmp_path / "x"), "--layers", "2", "--experts", "4", "--hidden", "300", "--dry-run")
    assert run.returncode == 2 and "--hidden" in run.stderr
    run = _script(str(tmp_path / "x"), "--layers", "2", "--experts", "4", "--max-shard-mb", "1", "--dry-run")
    assert run.returncode == 2 and "--max-shard-mb" in run.stderr and "embed.weight" in run.stderr
