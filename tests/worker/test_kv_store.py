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
          "chunk_size": 16, "dtype": "float32", "block_size": 8}


def run_peer(tmp_path: Path, tag: str, url: str, ops: list[dict], **layout: object) -> dict:
    spec_path, out_path = tmp_path / f"{tag}.json", tmp_path / f"{tag}.pt"
    spec_path.write_text(json.dumps({"url": url, **LAYOUT, **layout, "ops": ops}))
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
    # 45 tokens: 5 whole blocks of 8 are stored (2 chunks of 16 + a partial chunk of 8); the
    # last 5 tokens' partial block is left to the decode side. 40 tokens for the eviction case.
    full = list(range(1000, 1045))
    evicted = [7 * i % 500 for i in range(40)]
    kv_full, kv_evicted = random_kv(45, 0), random_kv(40, 1)
    torch.save(kv_full, tmp_path / "full.pt")
    torch.save(kv_evicted, tmp_path / "evicted.pt")
    # Prefill side: blocks scattered and out of order.
    prefill_blocks_45 = [9, 3, 7, 1, 5, 11]
    prefill_blocks_40 = [2, 4, 6, 8, 10]
    stored = run_peer(tmp_path, "store", redis_url, [
        {"kind": "store", "name": "full", "tokens": full, "kv_path": str(tmp_path / "full.pt"),
         "block_ids": prefill_blocks_45, "num_blocks": 12},
        {"kind": "store", "name": "evicted", "tokens": evicted,
         "kv_path": str(tmp_path / "evicted.pt"), "block_ids": prefill_blocks_40,
         "num_blocks": 12},
    ])
    assert stored["full"] == 40 and stored["evicted"] == 40
    assert [(s, e) for s, e, _ in stored["full.keys"]] == [(0, 16), (16, 32), (32, 40)]

    # Evict the middle chunk of the second prompt the way Redis's LRU would (both keys).
    client = redis.Redis.from_url(redis_url)
    middle_key = stored["evicted.keys"][1][2]
    assert client.delete(middle_key + "kv_bytes", middle_key + "metadata") == 2

    # Decode side: different block ids.
    decode_blocks_45 = [13, 2, 5, 17, 1, 8]
    got = run_peer(tmp_path, "retrieve", redis_url, [
        {"kind": "retrieve", "name": "full", "tokens": full, "block_ids": decode_blocks_45,
         "num_blocks": 21},
        {"kind": "retrieve", "name": "evicted", "tokens": evicted,
         "block_ids": list(range(1, 6)), "num_blocks": 12},
        {"kind": "retrieve", "name": "unknown", "tokens": [5] * 20, "block_ids": [1, 2, 3],
         "num_blocks": 6},
        # The engine already holds 20 tokens (prefix cache; 3 blocks with the partial one):
        # they must not be written.
        {"kind": "retrieve", "name": "skipped", "tokens": full, "block_ids": decode_blocks_45,
         "num_blocks": 21, "skip_tokens": 20},
        {"kind": "fetch", "name": "fetch_full", "tokens": full},
        {"kind": "fetch", "name": "fetch_evicted", "tokens": evicted},
        {"kind": "fetch", "name": "fetch_unknown", "tokens": [9] * 30},
        {"kind": "lookup", "name": "lookup_full", "tokens": full},
        # A longer prompt shares the two full chunks; its third chunk hashes differently.
        {"kind": "lookup", "name": "lookup_longer", "tokens": full + [1, 2, 3]},
        {"kind": "lookup", "name": "lookup_evicted", "tokens": evicted},
    ])
    assert stored["layout_fingerprint"] == got["layout_fingerprint"]
    assert got["full"] == 40
    assert torch.equal(got["full.kv"][:, :, :40], kv_full[:, :, :40])  # bit-exact
    assert got["full.kv"][:, :, 40:].isnan().all()  # the partial block: recomputed
    assert got["full.others_untouched"]
    assert got["evicted"] == 16  # only the chunk before the hole
    assert torch.equal(got["evicted.kv"][:, :, :16], kv_evicted[:, :, :16])
    assert got["evicted.kv"][:, :, 16:].isnan().all()  # the rest left for recompute
    assert got["evicted.others_untouched"]
    assert got["skipped"] == 40
    assert got["skipped.kv"][:, :, :24].isnan().all()
    assert torch.equal(got["skipped.kv"][:, :, 24:40], kv_full[:, :, 24:40])
    assert got["fetch_full"] == 40 and torch.equal(got["fetch_full.kv"], kv_full[:, :, :40])
    assert got["fetch_evicted"] == 16
    assert torch.equal(got["fetch_evicted.kv"][:, :, :16], kv_evicted[:, :, :16])
    assert got["fetch_unknown"] == 0 and got["fetch_unknown.kv"] is None
    assert got["unknown"] == 0
    assert got["unknown.kv"].isnan().all()
    assert got["lookup_full"] == 40
    assert got["lookup_longer"] == 32
    assert got["lookup_evicted"] == 16


def test_fp8_kv_is_stored_and_loaded_bit_exactly(redis_url: str, tmp_path: Path) -> None:
    """kv_dtype=fp8: blocks of e4m3fn K/V (half the bytes) go through LMCache and come back
    byte for byte in other blocks of another process; a float32 peer of the same model sees
    another layout fingerprint, so it never reads them."""
    tokens = list(range(2000, 2045))
    # values an FP8 cache holds exactly (the peer's scatter casts them), so equality is exact
    kv = random_kv(45, 2).to(torch.float8_e4m3fn).float()
    torch.save(kv, tmp_path / "kv8.pt")
    stored = run_peer(tmp_path, "store8", redis_url, [
        {"kind": "store", "name": "p", "tokens": tokens, "kv_path": str(tmp_path / "kv8.pt"),
         "block_ids": [4, 9, 1, 7, 3, 11], "num_blocks": 12}], kv_dtype="fp8")
    assert stored["p"] == 40
    got = run_peer(tmp_path, "load8", redis_url, [
        {"kind": "retrieve", "name": "p", "tokens": tokens, "block_ids": [2, 13, 5, 8, 1, 6],
         "num_blocks": 14},
        {"kind": "fetch", "name": "f", "tokens": tokens}], kv_dtype="fp8")
    assert got["layout_fingerprint"] == stored["layout_fingerprint"]
    assert got["p"] == 40 and torch.equal(got["p.kv"][:, :, :40], kv[:, :, :40])
    assert got["p.others_untouched"]
    assert got["f"] == 40 and torch.equal(got["f.kv"], kv[:, :, :40])
    wide = run_peer(tmp_path, "lookup32", redis_url, [
        {"kind": "lookup", "name": "l", "tokens": tokens}])
    assert wide["layout_fingerprint"] != stored["layout_fingerprint"] and wide["l"] == 0


def test_layout_fingerprint_tracks_what_the_bytes_mean() -> None:
    base = KVStoreConfig(url="redis://127.0.0.1:6379", model_name="m", engine_layout="paged-a",
                         block_size=8, bytes_per_block=1000, chunk_size=16)
    same = KVStoreConfig(url="lm://10.0.0.1:5000", model_name="m", engine_layout="paged-a",
                         block_size=8, bytes_per_block=1000, chunk_size=16)
    assert base.layout_fingerprint == same.layout_fingerprint  # where it lives does not matter
    for change in ({"engine_layout": "v4-blocks"}, {"chunk_size": 32}, {"block_size": 16},
                   {"bytes_per_block": 1004}, {"model_name": "other"}):
        other = KVStoreConfig(**{**base.__dict__, **change})
        assert other.layout_fingerprint != base.layout_fingerprint, change


@pytest.mark.parametrize("url, needle", [
    ("http://127.0.0.1:6379", "scheme"),
    ("redis://127.0.0.1", "host and port"),
    ("mock://x", "scheme"),
])
def test_bad_store_url_is_refused_with_the_url_named(url: str, needle: str) -> None:
    with pytest.raises(KVStoreError, match=needle):
        KVStoreConfig(url=url, model_name="m", engine_layout="x", block_size=8,
                      bytes_per_block=64)


def test_chunks_must_hold_whole_blocks() -> None:
    with pytest.raises(KVStoreError, match="chunk_size=20 must be a multiple of the engine's "
                                           "block_size=8"):
        KVStoreConfig(url="redis://h:1", model_name="m", engine_layout="x", block_size=8,
                      bytes_per_block=64, chunk_size=20)


def test_unreachable_store_fails_at_start_naming_it() -> None:
    from launch.launcher import free_port
    from tests.worker.kv_peer import dense_layout
    from worker.kv_store import KVStore

    url = f"redis://127.0.0.1:{free_port()}"
    with pytest.raises(KVStoreError, match=f"cannot reach the KV store at {url}"):
        KVStore(url, "m", dense_layout({**LAYOUT}), chunk_size=16)


def test_public_url_strips_credentials() -> None:
    assert public_url("redis://user:secret@cache.local:6380/0") == "redis://cache.local:6380/0"
    assert "secret" not in public_url("redis://:secret@h:1")


def test_lm_server_fallback_round_trip(tmp_path: Path) -> None:
    """LMCache's own lm:// server (used when no redis-server is installed) stores and serves
    the same bytes, partial last chunk (of whole blocks) included."""
    from launch.launcher import start_lm_server

    proc, url = start_lm_server(log_dir=tmp_path)
    try:
        tokens = list(range(2000, 2045))
        kv = random_kv(45, 7)
        torch.save(kv, tmp_path / "kv.pt")
        got = run_peer(tmp_path, "lm", url, [
            {"kind": "store", "name": "s", "tokens": tokens, "kv_path": str(tmp_path / "kv.pt"),
             "block_ids": [4, 2, 6, 9, 11, 13], "num_blocks": 14},
            {"kind": "retrieve", "name": "r", "tokens": tokens, "block_ids": [1, 7, 3, 5, 2, 6],
             "num_blocks": 8},
            {"kind": "lookup", "name": "prefix", "tokens": tokens[:44]},
            {"kind": "lookup", "name": "shorter", "tokens": tokens[:36]},
        ])
    finally:
        proc.stop(grace_s=5.0)
    assert got["s"] == 40 and got["r"] == 40 and torch.equal(got["r.kv"][:, :, :40], kv[:, :, :40])
    assert got["prefix"] == 40  # its whole blocks are the stored chunks
    assert got["shorter"] == 32  # 32 tokens of whole blocks: two full stored chunks
