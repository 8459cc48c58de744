"""Tensor-parallel loading reads each rank's slices only: counted at the safetensors reader. A
rank never reads a split tensor whole, reads exactly its share of each split weight (the dense
families' q/k/v/o/MLP, V4's query heads and output groups, FP8 included) with the scale rows that
cover it, and never reads another rank's V4 experts (MXFP4 per-expert tensors); a bias only rank
0 adds costs the others no read at all."""

from __future__ import annotations

import re
from collections import defaultdict

import pytest
import torch
from safetensors.torch import load_file

import engine.safetensors_loader as reader
from engine.checkpoint import load_checkpoint
from tests.engine.conftest import build_tiny_model


class _SliceSpy:
    def __init__(self, real, name: str, log: dict) -> None:
        self.real, self.name, self.log = real, name, log

    def get_shape(self):
        return self.real.get_shape()

    def get_dtype(self):
        return self.real.get_dtype()

    def __getitem__(self, index):
        t = self.real[index]
        self.log[self.name].append(("slice", t.numel() * t.element_size()))
        return t


class _FileSpy:
    """The real ``safe_open`` handle, every tensor read recorded with its bytes."""

    def __init__(self, real, log: dict) -> None:
        self.real, self.log = real, log

    def __enter__(self):
        self.f = self.real.__enter__()
        return self

    def __exit__(self, *exc):
        return self.real.__exit__(*exc)

    def keys(self):
        return self.f.keys()

    def get_tensor(self, name: str):
        t = self.f.get_tensor(name)
        self.log[name].append(("whole", t.numel() * t.element_size()))
        return t

    def get_slice(self, name: str):
        return _SliceSpy(self.f.get_slice(name), name, self.log)


def _reads(monkeypatch, folder, rank: int, size: int) -> dict[str, list[tuple[str, int]]]:
    log: dict[str, list[tuple[str, int]]] = defaultdict(list)
    real_open = reader.safe_open
    monkeypatch.setattr(reader, "safe_open", lambda *a, **k: _FileSpy(real_open(*a, **k), log))
    load_checkpoint(folder, dtype=torch.float32, progress=False, tensor_parallel=(rank, size))
    monkeypatch.setattr(reader, "safe_open", real_open)
    return log


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def test_dense_ranks_read_their_share(monkeypatch, tmp_path) -> None:
    build_tiny_model("llama", attention_bias=True).save_pretrained(tmp_path)
    whole = load_file(tmp_path / "model.safetensors")
    split = re.compile(r"(q_proj|k_proj|v_proj)\.(weight|bias)$"
                       r"|(o_proj|gate_proj|up_proj|down_proj)\.weight$")
    totals = []
    for rank in (0, 1):
        log = _reads(monkeypatch, tmp_path, rank, 2)
        for name, t in whole.items():
            kinds = [k for k, _ in log[name]]
            if split.search(name):
                assert kinds == ["slice"], (name, kinds)
                assert log[name][0][1] * 2 == _bytes(t), name  # 2 of 4 heads, 44 of 88 rows
            elif name.endswith("o_proj.bias"):
                # added once after the all-reduce: rank 1 holds zeros and reads nothing
                assert log[name] == ([("whole", _bytes(t))] if rank == 0 else [("slice", 0)])
            else:
                assert kinds == ["whole"], (name, kinds)
        totals.append(sum(b for reads in log.values() for _, b in reads))
    assert totals[1] < totals[0] < sum(_bytes(t) for t in whole.values())


@pytest.fixture(scope="module")
def v4_quantized(tmp_path_factory):
    """V4 as shipped (FP8 projections, MXFP4 experts, DeepSeek's layout), cuts on block edges:
    4 heads x 64 = 256 query rows, 2 output groups x 128 = 256, 8 routed experts."""
    from transformers import DeepseekV4Config as HFConfig
    from transformers import DeepseekV4ForCausalLM

    from tests.engine.deepseek_v4._quantized_ckpt import write_quantized
    from tests.engine.deepseek_v4.test_deepseek_v4_quantized import RAW

    torch.manual_seed(0)
    raw = {**RAW, "n_routed_experts": 8, "head_dim": 64, "o_lora_rank": 128, "index_head_dim": 32}
    folder = tmp_path_factory.mktemp("v4q")
    write_quantized(DeepseekV4ForCausalLM(HFConfig(**raw)).eval(), folder)
    return folder


def test_v4_ranks_read_their_heads_groups_and_experts(monkeypatch, v4_quantized) -> None:
    whole = load_file(v4_quantized / "model.safetensors")
    expert = re.compile(r"\.ffn\.experts\.(\d+)\.")
    heads = re.compile(r"\.attn\.(wq_b|wo_a|wo_b)\.(weight|scale)$|\.attn\.attn_sink$")
    assert any(heads.search(n) and n.endswith("scale") for n in whole)  # FP8 grids present
    assert any(expert.search(n) and whole[n].dtype == torch.int8 for n in whole)  # MXFP4
    for rank in (0, 1):
        log = _reads(monkeypatch, v4_quantized, rank, 2)
        for name, t in whole.items():
            kinds = [k for k, _ in log[name]]
            e = expert.search(name)
            if e is not None:  # experts 0-3 on rank 0, 4-7 on rank 1; the others never read
                mine = int(e.group(1)) // 4 == rank
                assert kinds == (["whole"] if mine else []), (name, kinds)
            elif heads.search(name):
                assert kinds == ["slice"], (name, kinds)
                assert log[name][0][1] * 2 == _bytes(t), name  # half the rows or columns
            else:
                assert kinds == ["whole"], (name, kinds)  # KV head, indexer, gate, shared, ...
        read = sum(b for reads in log.values() for _, b in reads)
        split = sum(_bytes(t) for n, t in whole.items() if expert.search(n) or heads.search(n))
        assert read == sum(_bytes(t) for t in whole.values()) - split // 2
