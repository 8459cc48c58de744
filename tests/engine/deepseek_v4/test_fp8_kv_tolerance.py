"""``kv_cache_dtype=fp8`` on DeepSeek-V4 (compressed entries and indexer keys in e4m3 with an
fp32 scale per row, engine/models/deepseek_v4/memory/paged_rows.py): against the same engine with KV in
the model dtype, over prompts that span several chunks (so later chunks and every decode step
read stored FP8 entries), the greedy tokens are the same and each token's log-probability is
within TOLERANCE nats. The difference is not zero: FP8 really is what the steps read."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from lab.bench.deepseek_v4.write_checkpoint import flash_hf_config

TOLERANCE = 0.05  # nats, per generated token's log-probability


def _run(folder: Path, kv_dtype: str) -> dict[str, list[tuple[int, float]]]:
    engine = LLMEngine.from_config(EngineConfig(
        model=str(folder), device="cpu", load_format="dummy", kv_dtype=kv_dtype, max_batch=4,
        chunk_tokens=32, max_context=512))
    gen = torch.Generator().manual_seed(0)
    for i in range(4):
        prompt = torch.randint(2, 512, (150 + 37 * i,), generator=gen).tolist()
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=8, temperature=0,
                                                           logprobs=1, ignore_eos=True))
    out: dict[str, list[tuple[int, float]]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            for lp in o.logprobs or []:
                out.setdefault(o.request_id, []).append((lp.token_id, lp.logprob))
    return out


def test_fp8_kv_keeps_tokens_and_logprobs_within_tolerance(tmp_path: Path) -> None:
    hf = flash_hf_config(4, 4, hidden=256, vocab=512)
    hf["max_position_embeddings"] = 1024
    (tmp_path / "config.json").write_text(json.dumps(hf))
    ref, fp8 = _run(tmp_path, "auto"), _run(tmp_path, "fp8")
    assert ref.keys() == fp8.keys() and all(len(v) == 8 for v in ref.values())
    worst = 0.0
    for rid in ref:
        assert [t for t, _ in fp8[rid]] == [t for t, _ in ref[rid]], rid
        worst = max(worst, *(abs(a - b) for (_, a), (_, b) in zip(ref[rid], fp8[rid],
                                                                  strict=True)))
    assert 0 < worst < TOLERANCE
