"""The V4 handoff benchmark (lab/bench/deepseek_v4/handoff.py) runs end to end on a toy config on
the CPU through a real KV server (its own OS process, as LMCache starts threads): every block
arrives bit-exact with the window snapshot of the last one (the decode side can resume there),
the partial last block is left to recompute, and the bytes moved are the blocks plus one window
per resume point stored (the decode side fetches one)."""

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
        [sys.executable, "-m", "lab.bench.deepseek_v4.handoff", "--tiny", "--prompts", "1000,2053",
         "--chunk", "64", "--prefill-chunk", "500", "--staging-gb", "0.1", "--out", str(out),
         "--log-dir", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    bs, bpb, wb = res["block_size"], res["bytes_per_block"], res["resume_state_bytes"]
    assert res["bytes_per_token"] == bpb / bs and wb > 0
    # windows at the last block end of each 500-token step: 496, 992; 496, ..., 1984, 2048
    for row, n, windows in zip(res["rows"], (1000, 2053), (2, 5), strict=True):
        assert row["prompt_tokens"] == n and row["bit_exact"]
        assert row["loaded_tokens"] == n // bs * bs == row["stored_tokens"]
        # the window at the last block end came along: the decode side resumes there
        assert row["resumable_tokens"] == row["loaded_tokens"]
        # compact: blocks + each stored window once; the decode side fetches one window
        assert row["stored_window_bytes"] == windows * wb
        assert row["stored_bytes"] == n // bs * bpb + windows * wb
        assert row["fetched_bytes"] == n // bs * bpb + wb
