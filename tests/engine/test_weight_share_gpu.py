"""GPU tier: two processes on one GPU share one copy of the weights (engine/weight_share.py).
The first exports them through CUDA IPC, the second maps them: both stream the same greedy
tokens as an engine that loaded its own copy, the second's plan counts the weights as mapped,
and what its caching allocator holds stays within its own (weightless) plan."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench.synthetic_model import SHAPES, write_llama
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
PEER = Path(__file__).with_name("weight_share_peer.py")
PROMPTS = [[5, 9, 13, 7, 21, 3, 8], [17] * 37]


def test_two_processes_share_one_copy_of_the_weights(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # 4 layers, hidden 1024, vocab 64000: an arena of ~0.35 GB, far above allocator noise
    monkeypatch.setitem(SHAPES, "mid", dict(vocab_size=64000, hidden_size=1024,
                                            intermediate_size=2816, num_hidden_layers=4,
                                            num_attention_heads=8, num_key_value_heads=2,
                                            rope_theta=10000.0, max_position_embeddings=4096))
    model = write_llama(tmp_path / "mid", "mid", device="cuda")
    spec = {"model": str(model), "handle": str(tmp_path / "w.handle"), "prompts": PROMPTS,
            "n": 12, "release": str(tmp_path / "release")}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = []
    try:
        for role in ("first", "second"):
            procs.append(subprocess.Popen(
                [sys.executable, str(PEER), str(tmp_path / "spec.json"),
                 str(tmp_path / f"{role}.json")], env=env))
            if role == "first":  # the first holds the loader claim before the second starts
                deadline = time.monotonic() + 60
                while not (tmp_path / "w.handle.lock").exists():
                    assert procs[0].poll() is None and time.monotonic() < deadline
                    time.sleep(0.05)
        assert procs[1].wait(timeout=300) == 0
        (tmp_path / "release").touch()
        assert procs[0].wait(timeout=60) == 0
    finally:
        for p in procs:
            p.kill()
    first = json.loads((tmp_path / "first.json").read_text())
    second = json.loads((tmp_path / "second.json").read_text())
    assert first["owned"] and not second["owned"]
    assert first["arena_bytes"] == second["arena_bytes"] > 300 << 20

    terms = {t["name"]: t for t in second["plan"]["terms"]}
    assert terms["weights"]["bytes"] == 0
    assert terms["weights_mapped"]["bytes"] == second["arena_bytes"] and terms["weights_mapped"]["mapped"]
    first_terms = {t["name"]: t for t in first["plan"]["terms"]}
    assert first_terms["weights"]["bytes"] == first["arena_bytes"]
    assert "weights_mapped" not in first_terms
    # The mapping process never made its own copy: its allocator holds less than the arena,
    # and about an arena less than the exporter's (same plan otherwise).
    assert second["reserved"] < second["arena_bytes"]
    assert first["reserved"] - second["reserved"] >= 0.9 * first["arena_bytes"]
    assert first["allocs_after_warmup"] == 0 and second["allocs_after_warmup"] == 0

    ec = EngineConfig(model=str(model), device="cuda", max_context=256, chunk_tokens=64,
                      max_batch=2, memory_utilization=0.1)
    plain = LLMEngine.from_config(ec)
    for i, p in enumerate(PROMPTS):
        plain.add_request(str(i), p, SamplingParams(max_tokens=12, temperature=0,
                                                    ignore_eos=True))
    tokens: dict[str, list[int]] = {"0": [], "1": []}
    while plain.has_unfinished():
        for r in plain.step():
            tokens[r.request_id] += r.new_token_ids
    assert first["tokens"] == second["tokens"] == [tokens["0"], tokens["1"]]
