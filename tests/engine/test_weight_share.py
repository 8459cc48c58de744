"""One-box weight sharing (engine/weight_share.py), CPU tier: the arena layout and views, the
plan's owned vs mapped accounting, the loader claim between processes, and the clean refusal
without CUDA. The CUDA IPC path itself is in test_weight_share_gpu.py."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from common.settings import load_worker_settings
from engine import weight_share as ws
from engine.checkpoint import load_checkpoint
from engine.config import EngineConfig
from engine.errors import PlanError
from engine.llm_engine import LLMEngine
from engine.memory_planner import make_plan
from engine.sampling_params import SamplingParams
from worker.worker_config import WorkerConfig


def _greedy(engine: LLMEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for r in engine.step():
            out[r.request_id] += r.new_token_ids
    return [out[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v biases are fused too
def test_packed_arena_serves_the_same_tokens(family: str,
                                             make_tiny_checkpoint: Callable[..., Path]) -> None:
    folder = make_tiny_checkpoint(family)
    ec = EngineConfig(model=str(folder), device="cpu", max_context=96, chunk_tokens=24,
                      max_batch=3)
    prompts = [[5, 9, 13, 7, 21, 3, 8], [17] * 11, [2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 1, 3]]
    plain = _greedy(LLMEngine.from_config(ec), prompts, 9)

    ckpt = load_checkpoint(folder, dtype=torch.float32)
    total = sum(t.numel() * t.element_size() for t in ckpt.state_dict.values())
    shared = ws.pack(ckpt.state_dict, torch.device("cpu"))
    assert not ckpt.state_dict  # every source was moved into the arena
    assert total <= shared.nbytes < total + ws.ALIGN * 64
    views = shared.tensors()
    lo, hi = shared.arena.data_ptr(), shared.arena.data_ptr() + shared.nbytes
    for name, t in views.items():  # nothing owns memory of its own
        assert lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi, name
    qkv = views["model.layers.1.self_attn.qkv_proj.weight"]
    q, k = views["model.layers.1.self_attn.q_proj.weight"], views["model.layers.1.self_attn.k_proj.weight"]
    assert q.data_ptr() == qkv.data_ptr() and k.data_ptr() == qkv[q.shape[0]:].data_ptr()
    if family == "qwen2":
        assert "model.layers.0.self_attn.qkv_proj.bias" in views
    engine = LLMEngine(ec, ckpt.config, views, ckpt.model_fingerprint, shared=shared)
    assert engine.plan.term("weights") == shared.nbytes
    assert _greedy(engine, prompts, 9) == plain


def test_plan_counts_mapped_weights_outside_its_total(
        make_tiny_checkpoint: Callable[..., Path]) -> None:
    folder = make_tiny_checkpoint("llama")
    cfg = load_checkpoint(folder, dtype=torch.float32).config
    ec = EngineConfig(model=str(folder), device="cpu", max_context=64, chunk_tokens=16,
                      max_batch=2)
    weights = 3 << 30  # bigger than the budget on its own: only a mapped copy can fit
    owned = make_plan(cfg, ec, 4 << 30, weights)
    mapped = make_plan(cfg, ec, 4 << 30, 0, mapped_weight_bytes=weights)
    assert owned.term("weights") == weights and owned.mapped_bytes == 0
    assert mapped.term("weights") == 0 and mapped.term("weights_mapped") == weights
    assert mapped.mapped_bytes == weights
    assert owned.total_bytes - mapped.total_bytes == weights
    assert not make_plan(cfg, ec, 1 << 30, weights).fits
    assert make_plan(cfg, ec, 1 << 30, 0, mapped_weight_bytes=weights).fits
    row = next(r for r in mapped.table().splitlines() if r.startswith("weights_mapped"))
    assert "not in the total" in row
    assert [t["mapped"] for t in mapped.to_json()["terms"] if t["name"] == "weights_mapped"] \
        == [True]


def test_without_cuda_share_weights_is_refused_naming_it(
        make_tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    folder = make_tiny_checkpoint("llama")
    ec = EngineConfig(model=str(folder), device="cpu", max_context=64, chunk_tokens=16,
                      share_weights=str(tmp_path / "w.handle"))
    with pytest.raises(PlanError, match="share_weights needs a CUDA device"):
        LLMEngine.from_config(ec)
    assert not (tmp_path / "w.handle").exists()
    shared = ws.pack(load_checkpoint(folder, dtype=torch.float32).state_dict,
                     torch.device("cpu"))
    with pytest.raises(PlanError, match="needs a CUDA device"):
        ws.export(shared, tmp_path / "w.handle", {})


def test_worker_settings_reach_the_engine(tmp_path: Path) -> None:
    s = load_worker_settings("decode", ["--model", "m", "--share-weights", str(tmp_path / "h"),
                                        "--share-weights-timeout-s", "12"], env={})
    ec = WorkerConfig.from_settings(s).engine
    assert ec.share_weights == str(tmp_path / "h") and ec.share_weights_timeout_s == 12
    with pytest.raises(Exception, match="share_weights_timeout_s"):
        load_worker_settings("decode", ["--model", "m", "--share-weights-timeout-s", "0"],
                             env={})


def test_one_process_claims_the_load_and_a_dead_claim_is_taken_over(tmp_path: Path) -> None:
    handle = tmp_path / "w.handle"
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = handle.with_name(handle.name + ".lock")
        lock.write_text(str(holder.pid))  # another live process holds the claim
        assert ws.claim_loader(handle) is False
        with pytest.raises(PlanError, match="after 0 s"):
            ws.wait_for_export(handle, timeout_s=0.3)
        # A handle an earlier exporter left behind (another pid) is never mapped...
        stale = {"version": ws.HANDLE_VERSION, "pid": holder.pid + 1, "reduced": None}
        handle.write_bytes(pickle.dumps(stale))
        with pytest.raises(PlanError, match="after 0 s"):
            ws.wait_for_export(handle, timeout_s=0.3)
        # ...the claim holder's is.
        handle.write_bytes(pickle.dumps({**stale, "pid": holder.pid}))
        assert ws.wait_for_export(handle, timeout_s=5.0)["pid"] == holder.pid
    finally:
        holder.kill()
        holder.wait()
    with pytest.raises(PlanError, match=f"process {holder.pid} that loads .* is not running"):
        ws.wait_for_export(handle, timeout_s=5.0)
    assert ws.claim_loader(handle) is True  # the dead claim is taken over
    assert lock.read_text() == str(os.getpid())
    assert ws.claim_loader(handle) is False  # ours now, and we are alive
