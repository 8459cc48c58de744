"""A CPU engine records a warm-up that passed (engine/warmup_record.py); an engine built again
with the same model, config, torch and code skips the warm-up's steps and serves the same
tokens; any other setting runs them again."""

from __future__ import annotations

import torch

from engine.checkpoint import load_checkpoint
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.warmup_record import WarmupRecord
from tests.engine.conftest import build_tiny_model
from tests.helpers.engine_greedy import engine_greedy

PROMPT = [5, 9, 17, 33, 60]


def build(folder, record_dir, **kw) -> tuple[LLMEngine, list[str]]:
    ckpt = load_checkpoint(folder, dtype=torch.float32, progress=False)
    said: list[str] = []
    ec = EngineConfig(**{**dict(model=str(folder), device="cpu", dtype="float32",
                                max_context=256, chunk_tokens=32, max_batch=4, block_size=16,
                                attn_tile_tokens=64, warmup_record_dir=str(record_dir)), **kw})
    return LLMEngine(ec, ckpt.config, ckpt.state_dict, ckpt.model_fingerprint,
                     progress=said.append), said


def greedy(engine: LLMEngine) -> list[int]:
    return engine_greedy(engine, PROMPT, 8, "r")


def test_a_restart_with_the_same_everything_skips_the_warmup(tmp_path) -> None:
    folder = tmp_path / "qwen2"
    build_tiny_model("qwen2").save_pretrained(folder)
    records = tmp_path / "records"

    first, said = build(folder, records)
    assert any(s.startswith("warm-up 1/") for s in said)
    assert len(list(records.glob("warmup-passed-*.json"))) == 1
    tokens = greedy(first)

    again, said = build(folder, records)
    assert not any(s.startswith("warm-up 1/") for s in said)
    assert any("warm-up skipped" in s for s in said)
    assert again.warmup_report == first.warmup_report
    assert greedy(again) == tokens

    other, said = build(folder, records, max_batch=2)  # another plan: its steps run
    assert any(s.startswith("warm-up 1/") for s in said)
    assert len(list(records.glob("warmup-passed-*.json"))) == 2


def test_the_key_covers_the_model_config_torch_and_code() -> None:
    ec = EngineConfig(model="m", device="cpu")
    key = WarmupRecord.for_engine("/r", ec, "fp", "2.13").path
    assert key == WarmupRecord.for_engine("/r", ec, "fp", "2.13").path
    assert key != WarmupRecord.for_engine("/r", ec, "fp2", "2.13").path
    assert key != WarmupRecord.for_engine("/r", ec, "fp", "2.14").path
    other = EngineConfig(model="m", device="cpu", chunk_tokens=ec.chunk_tokens + 1)
    assert key != WarmupRecord.for_engine("/r", other, "fp", "2.13").path
