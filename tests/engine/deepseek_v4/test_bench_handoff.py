"""The V4 handoff benchmark (bench/deepseek_v4/handoff.py) runs end to end on a toy config on
the CPU through a real KV server (its own OS process, as LMCache starts threads): every block
arrives bit-exact with the window snapshot of the last one (the decode side can resume there),
the partial last block is left to recompute, bytes per token match the layout's export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from worker.kv_store_config import worker_environment

REPO = Path(__file__).resolve().parents[3]


def test_handoff_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "h.json"
    env = {**os.environ, **worker_environment(), "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.deepseek_v4.handoff", "--tiny", "--prompts", "1000,2053",
         "--chunk", "64", "--staging-gb", "0.1", "--out", str(out), "--log-dir", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["bytes_per_token"] == res["bytes_per_block"] / res["block_size"]
    # what moves: each block + a window section (snapshot or zeros) beside it
    assert res["export_bytes_per_block"] > res["bytes_per_block"]
    for row, n in zip(res["rows"], (1000, 2053), strict=True):
        assert row["prompt_tokens"] == n and row["bit_exact"]
        assert row["loaded_tokens"] == n // 16 * 16 == row["stored_tokens"]
        # the window at the last block end came along: the decode side resumes there
        assert row["resumable_tokens"] == row["loaded_tokens"]
        assert row["bytes_per_token"] == res["export_bytes_per_token"]
