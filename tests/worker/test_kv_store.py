"""KV handoff through LMCache + a real redis-server, between two OS processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import torch

from common.redact import public_url
from worker.kv_store_config import KVStoreConfig, KVStoreError, worker_environment

REPO = Path(__file__).resolve().parents[2]
PEER = Path(__file__).with_name("kv_peer.py")
LAYOUT = {"model_name": "tiny-test", "num_layers": 3, "num_kv_heads": 2, "head_dim": 12,
          "chunk_size": 16, "dtype": "float32"}


def run_peer(tmp_path: Path, tag: str, url: str, ops: list[dict]) -> dict:
    spec_path, out_path = tmp_path / f"{tag}.json", tmp_path / f"{tag}.pt"
    spec_path.write_text(json.dumps({"url": url, **LAYOUT, "ops": ops}))
    env = {**os.environ, **worker_environment(), "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(PEER), str(spec_path), str(out_path)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out_path)


def random_kv(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # [L, 2, n, H, D]
    return torch.randn(LAYOUT["num_layers"], 2, n, LAYOUT["num_kv_heads"], LAYOUT["head_dim"],
                       generator=g)


def test_store_in_one_process_retrieve_in_another(redis_url: str, tmp_path: Path) -> None:
    # 45 tokens = 2 full chunks of 16 + a partial chunk of 13; 40 tokens for the eviction case.
    full = list(range(1000, 1045))
    evicted = [7 * i % 500 for i in range(40)]
    kv_full, kv_evicted = random_kv(45, 0), random_kv(40, 1)
    torch.save(kv_full, tmp_path / "full.pt")
    torch.save(kv_evicted, tmp_path / "evicted.pt")
    # Prefill side: block size 8, blocks scattered and out of order.
    prefill_blocks_45 = [9, 3, 7, 1, 5, 11]
    prefill_blocks_40 = [2, 4, 6, 8, 10]
    stored = run_peer(tmp_path, "store", redis_url, [
        {"kind": "store", "name": "full", "tokens": full, "kv_path": str(tmp_path / "full.pt"),
         "block_ids": prefill_blocks_45, "num_blocks": 12, "block_size": 8},
        {"kind": "store", "name": "evicted", "tokens": evicted,
         "kv_path": str(tmp_path / "evicted.pt"), "block_ids": prefill_blocks_40,
         "num_blocks": 12, "block_size": 8},
    ])
    assert stored["full"] == 45 and stored["evicted"] == 40
    assert [(s, e) for s, e, _ in stored["full.keys"]] == [(0, 16), (16, 32), (32, 45)]

    # Evict the middle chunk of the second prompt the way Redis's LRU would (both keys).
    client = redis.Redis.from_url(redis_url)
    middle_key = stored["evicted.keys"][1][2]
    assert client.delete(middle_key + "kv_bytes", middle_key + "metadata") == 2

    # Decode side: a different block size (4) and different block ids.
    decode_blocks_45 = [13, 2, 5, 17, 1, 8, 3, 20, 11, 4, 6, 15]
    got = run_peer(tmp_path, "retrieve", redis_url, [
        {"kind": "retrieve", "name": "full", "tokens": full, "block_ids": decode_blocks_45,
         "num_blocks": 21, "block_size": 4},
        {"kind": "retrieve", "name": "evicted", "tokens": evicted,
         "block_ids": list(range(1, 11)), "num_blocks": 12, "block_size": 4},
        {"kind": "retrieve", "name": "unknown", "tokens": [5] * 20, "block_ids": [1, 2, 3, 4, 5],
         "num_blocks": 6, "block_size": 4},
        # The engine already holds 20 tokens (prefix cache): they must not be written.
        {"kind": "retrieve", "name": "skipped", "tokens": full, "block_ids": decode_blocks_45,
         "num_blocks": 21, "block_size": 4, "skip_tokens": 20},
        {"kind": "fetch", "name": "fetch_full", "tokens": full},
        {"kind": "fetch", "name": "fetch_evicted", "tokens": evicted},
        {"kind": "fetch", "name": "fetch_unknown", "tokens": [9] * 30},
        {"kind": "lookup", "name": "lookup_full", "tokens": full},
        # A longer prompt shares the two full chunks; its third chunk hashes differently.
        {"kind": "lookup", "name": "lookup_longer", "tokens": full + [1, 2, 3]},
        {"kind": "lookup", "name": "lookup_evicted", "tokens": evicted},
    ])
    assert stored["layout_fingerprint"] == got["layout_fingerprint"]
    assert got["full"] == 45
    assert torch.equal(got["full.kv"], kv_full)  # bit-exact, partial last chunk included
    assert got["full.others_untouched"]
    assert got["evicted"] == 16  # only the chunk before the hole
    assert torch.equal(got["evicted.kv"][:, :, :16], kv_evicted[:, :, :16])
    assert got["evicted.kv"][:, :, 16:].isnan().all()  # the rest left for recompute
    assert got["evicted.others_untouched"]
    assert got["skipped"] == 45
    assert got["skipped.kv"][:, :, :20].isnan().all()
    assert torch.equal(got["skipped.kv"][:, :, 20:], kv_full[:, :, 20:])
    assert got["fetch_full"] == 45 and torch.equal(got["fetch_full.kv"], kv_full)
    assert got["fetch_evicted"] == 16
    assert torch.equal(got["fetch_evicted.kv"][:, :, :16], kv_evicted[:, :, :16])
    assert got["fetch_unknown"] == 0 and got["fetch_unknown.kv"] is None
    assert got["unknown"] == 0
    assert got["unknown.kv"].isnan().all()
    assert got["lookup_full"] == 45
    assert got["lookup_longer"] == 32
    assert got["lookup_evicted"] == 16


def test_layout_fingerprint_tracks_what_the_bytes_mean() -> None:
    base = KVStoreConfig(url="redis://127.0.0.1:6379", model_name="m", num_layers=2,
                         num_kv_heads=2, head_dim=8, dtype=torch.float16, chunk_size=16)
    same = KVStoreConfig(url="lm://10.0.0.1:5000", model_name="m", num_layers=2,
                         num_kv_heads=2, head_dim=8, dtype=torch.float16, chunk_size=16)
    assert base.layout_fingerprint == same.layout_fingerprint  # where it lives does not matter
    for change in ({"dtype": torch.bfloat16}, {"chunk_size": 32}, {"num_kv_heads": 1},
                   {"head_dim": 16}, {"num_layers": 3}, {"model_name": "other"}):
        other = KVStoreConfig(**{**base.__dict__, **change})
        assert other.layout_fingerprint != base.layout_fingerprint, change


@pytest.mark.parametrize("url, needle", [
    ("http://127.0.0.1:6379", "scheme"),
    ("redis://127.0.0.1", "host and port"),
    ("mock://x", "scheme"),
])
def test_bad_store_url_is_refused_with_the_url_named(url: str, needle: str) -> None:
    with pytest.raises(KVStoreError, match=needle):
        KVStoreConfig(url=url, model_name="m", num_layers=1, num_kv_heads=1, head_dim=8,
                      dtype=torch.float32)


def test_unreachable_store_fails_at_start_naming_it() -> None:
    from launch.launcher import free_port
    from worker.kv_store import KVStore

    url = f"redis://127.0.0.1:{free_port()}"
    with pytest.raises(KVStoreError, match=f"cannot reach the KV store at {url}"):
        KVStore(url, "m", 1, 1, 8, torch.float32)


def test_public_url_strips_credentials() -> None:
    assert public_url("redis://user:secret@cache.local:6380/0") == "redis://cache.local:6380/0"
    assert "secret" not in public_url("redis://:secret@h:1")


def test_lm_server_fallback_round_trip(tmp_path: Path) -> None:
    """LMCache's own lm:// server (used when no redis-server is installed) stores and serves
    the same bytes, partial last chunk included."""
    from launch.launcher import start_lm_server

    proc, url = start_lm_server(log_dir=tmp_path)
    try:
        tokens = list(range(2000, 2045))
        kv = random_kv(45, 7)
        torch.save(kv, tmp_path / "kv.pt")
        got = run_peer(tmp_path, "lm", url, [
            {"kind": "store", "name": "s", "tokens": tokens, "kv_path": str(tmp_path / "kv.pt"),
             "block_ids": [4, 2, 6], "num_blocks": 8, "block_size": 16},
            {"kind": "retrieve", "name": "r", "tokens": tokens, "block_ids": [1, 7, 3, 5, 2, 6],
             "num_blocks": 8, "block_size": 8},
            {"kind": "lookup", "name": "prefix", "tokens": tokens[:40]},
        ])
    finally:
        proc.stop(grace_s=5.0)
    assert got["s"] == 45 and got["r"] == 45 and torch.equal(got["r.kv"], kv)
    assert got["prefix"] == 32
