"""A decode worker's KV store under concurrency, with real Redis and real LMCache: a lookup
never waits behind another prompt's fetch, and the lock-free read path (worker/staged_fetch.py)
returns exactly the bytes LMCache stored, stopping at a chunk Redis lost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from lab.bench.deepseek_v4.handoff import TINY_CONFIG
from tests.helpers.redis_server import running_redis
from tests.worker.test_kv_store import LAYOUT, random_kv, run_peer
from worker.kv_store_config import worker_environment

REPO = Path(__file__).resolve().parents[2]
FETCH_PEER = Path(__file__).with_name("kv_fetch_peer.py")
# 8 layers x 8 heads x 128 x fp32 x (K, V) = 64 KiB a token: 4,096 tokens are 256 MiB, slow
# enough to fetch (on any machine this suite runs on) to time lookups inside the fetch.
BIG = {"model_name": "fetch-test", "num_layers": 8, "num_kv_heads": 8, "head_dim": 128,
       "chunk_size": 256, "dtype": "float32", "block_size": 16, "num_tokens": 4096,
       "staging_gb": 0.3}


@pytest.fixture(scope="module")
def big_redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_redis(tmp_path_factory.mktemp("redis"), maxmemory_mb=1024) as url:
        yield url


def test_lookup_does_not_wait_behind_a_long_fetch(big_redis_url: str, tmp_path: Path) -> None:
    spec, out = tmp_path / "spec.json", tmp_path / "out.pt"
    spec.write_text(json.dumps({"url": big_redis_url, **BIG}))
    env = {**os.environ, **worker_environment(), "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(FETCH_PEER), str(spec), str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(out)
    assert got["visible"] == BIG["num_tokens"]
    assert got["fetched"] == BIG["num_tokens"] and got["equal"]  # bit-exact, all of it
    fetch_s = got["fetch_end"] - got["fetch_start"]
    inside = [(t1 - t0, n, hit) for t0, t1, n, hit in got["lookups"] if t1 < got["fetch_end"]]
    # Under one lock for the whole store, the first lookup would wait for the whole fetch and
    # none would finish inside it.
    assert len(inside) >= 3, (fetch_s, got["lookups"])
    assert max(d for d, _, _ in inside) < fetch_s / 3, (fetch_s, inside)
    assert {(n, hit) for _, n, hit in inside} == {(0, 0), (2 * BIG["chunk_size"], 1)}


def store_48(tmp_path: Path, redis_url: str, tokens: list[int],
             seed: int) -> tuple[torch.Tensor, dict]:
    """Store 48 tokens' random KV (3 chunks of 16, in shuffled blocks) from a peer process;
    returns the KV and the peer's results."""
    kv = random_kv(48, seed)
    torch.save(kv, tmp_path / "kv.pt")
    stored = run_peer(tmp_path, "store", redis_url, [
        {"kind": "store", "name": "p", "tokens": tokens, "kv_path": str(tmp_path / "kv.pt"),
         "block_ids": [5, 0, 4, 1, 3, 2], "num_blocks": 6}])
    assert stored["p"] == 48
    return kv, stored


def test_fetch_stops_at_a_chunk_whose_bytes_redis_evicted(redis_url: str,
                                                          tmp_path: Path) -> None:
    # Redis's LRU evicts keys one by one: a chunk may keep its metadata and lose its bytes.
    tokens = [3 * i % 700 + 1 for i in range(48)]  # 3 chunks of 16, blocks of 8
    kv, stored = store_48(tmp_path, redis_url, tokens, 5)
    client = redis.Redis.from_url(redis_url)
    assert client.delete(stored["p.keys"][2][2] + "kv_bytes") == 1
    got = run_peer(tmp_path, "fetch", redis_url, [
        {"kind": "lookup", "name": "lookup", "tokens": tokens},
        {"kind": "fetch", "name": "fetch", "tokens": tokens}])
    assert got["lookup"] == 48  # the metadata still says stored
    assert got["fetch"] == 32  # the read finds the hole and stops before it
    assert torch.equal(got["fetch.kv"], kv[:, :, :32])
    assert LAYOUT["chunk_size"] == 16


def test_padded_blocks_arrive_bit_exact(tmp_path: Path) -> None:
    # V4 in FP8 with blocks of 256: 2,944 B a block, padded to 3,072 in LMCache's chunks, so the
    # read lands in a strided view of the staging; partial last chunks (1,024 and 2,560 tokens
    # of chunks of 512 are whole, 2,700 is not) through the V4 handoff bench on the CPU.
    config = tmp_path / "tiny_v4.json"
    config.write_text(json.dumps(TINY_CONFIG))
    out = tmp_path / "h.json"
    env = {**os.environ, **worker_environment(), "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "lab.bench.deepseek_v4.handoff", "--config", str(config),
         "--device", "cpu", "--dtype", "bfloat16", "--kv-dtype", "fp8", "--block-size", "256",
         "--prompts", "1100,2700", "--chunk", "512", "--staging-gb", "0.1", "--out", str(out),
         "--log-dir", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["bytes_per_block"] % (2 * res["block_size"]) != 0  # the layout is padded
    for row, n in zip(res["rows"], (1100, 2700), strict=True):
        assert row["bit_exact"] and row["loaded_tokens"] == n // 256 * 256


def test_a_put_that_never_lands_ends_the_wait_at_the_stall_not_the_timeout(
        redis_url: str, tmp_path: Path) -> None:
    # LMCache only logs a dropped write (a socket timeout on a 16 GiB put did this on the H200):
    # with nothing new visible for ``stall_s`` the wait returns what is there.
    tokens = [5 * i % 900 + 2 for i in range(64)]
    store_48(tmp_path, redis_url, tokens[:48], 6)
    got = run_peer(tmp_path, "wait", redis_url, [
        {"kind": "wait_visible", "name": "w", "tokens": tokens, "timeout_s": 60.0,
         "stall_s": 0.5}])
    assert got["w"] == 48  # the three stored chunks, not the fourth that never came
    assert 0.5 <= got["w.s"] < 10.0
