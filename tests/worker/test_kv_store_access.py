"""The KV store behind a password and TLS (real redis-server with ``--requirepass`` / TLS, real
LMCache in separate processes): handoff works end to end, a wrong password fails at start-up
naming the store, no password ever reaches a log, and every chunk key carries a TTL."""

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

from tests.helpers.redis_server import running_redis
from tests.helpers.tls import write_tls_files
from tests.worker.test_kv_store import LAYOUT, PEER, REPO, random_kv
from worker.kv_store_config import worker_environment
from worker.lmcache_redis import REDIS_KEY_SUFFIXES

PASSWORD = "pw-Zq81-secret"
TTL_S = 90


def run_peer(tmp_path: Path, tag: str, url: str, ops: list[dict], *, ttl_s: int = TTL_S,
             ok: bool = True) -> tuple[dict | None, str]:
    """kv_peer.py in its own process with every logger at DEBUG; (results, stderr)."""
    spec_path, out_path = tmp_path / f"{tag}.json", tmp_path / f"{tag}.pt"
    spec_path.write_text(json.dumps({"url": url, **LAYOUT, "ops": ops, "ttl_s": ttl_s,
                                     "log_level": "debug"}))
    env = {**os.environ, **worker_environment(), "PYTHONPATH": str(REPO),
           "LMCACHE_LOG_LEVEL": "DEBUG"}
    proc = subprocess.run([sys.executable, str(PEER), str(spec_path), str(out_path)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert (proc.returncode == 0) == ok, proc.stderr[-4000:]
    return (torch.load(out_path) if ok else None), proc.stdout + proc.stderr


def store_op(tmp_path: Path, name: str, tokens: list[int], seed: int) -> dict:
    kv_path = tmp_path / f"{name}.kv.pt"
    torch.save(random_kv(len(tokens), seed), kv_path)
    num_blocks = (len(tokens) + 7) // 8
    return {"kind": "store", "name": name, "tokens": tokens, "kv_path": str(kv_path),
            "block_ids": list(range(1, num_blocks + 1)), "num_blocks": num_blocks + 1,
            "block_size": 8}


def ttls(client: redis.Redis, chunk_keys: list) -> dict[str, int]:
    return {k + s: client.ttl(k + s) for _, _, k in chunk_keys for s in REDIS_KEY_SUFFIXES}


@pytest.fixture(scope="module")
def password_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_redis(tmp_path_factory.mktemp("redis-pw"), password=PASSWORD) as url:
        yield url


def test_password_url_end_to_end_with_ttl_and_no_secret_logged(password_url: str,
                                                               tmp_path: Path) -> None:
    assert PASSWORD in password_url
    tokens = list(range(3000, 3045))  # 2 full chunks of 16 + a partial one
    stored, log = run_peer(tmp_path, "store", password_url, [store_op(tmp_path, "a", tokens, 3)])
    assert stored is not None and stored["a"] == 45
    client = redis.Redis.from_url(password_url)
    keys = ttls(client, stored["a.keys"])
    assert len(keys) == 6 and set(client.keys()) == {k.encode() for k in keys}
    assert all(0 < t <= TTL_S for t in keys.values()), keys
    # LMCache logged its remote URL (at INFO) and our filter masked the password in it
    assert "redis://:***@127.0.0.1" in log
    assert PASSWORD not in log

    # A reader with the same URL loads it bit-exact; a put of the same prompt (a reused
    # prefix) refreshes the TTL of its chunks.
    for key in keys:
        client.expire(key, 5)
    got, log = run_peer(tmp_path, "reuse", password_url, [
        {"kind": "fetch", "name": "f", "tokens": tokens},
        store_op(tmp_path, "again", tokens, 3)])
    assert got is not None and got["f"] == 45
    assert torch.equal(got["f.kv"], random_kv(45, 3))
    assert all(TTL_S - 30 < t <= TTL_S for t in ttls(client, stored["a.keys"]).values())
    assert PASSWORD not in log

    # kv_ttl_s = 0: no expiry at all
    other = list(range(5000, 5020))
    got, _ = run_peer(tmp_path, "no-ttl", password_url, [store_op(tmp_path, "b", other, 4)],
                      ttl_s=0)
    assert got is not None and got["b"] == 20
    assert set(ttls(client, got["b.keys"]).values()) == {-1}


def test_wrong_password_fails_at_start_naming_the_store_not_the_password(
        password_url: str, tmp_path: Path) -> None:
    wrong = password_url.replace(PASSWORD, "not-the-pw-77")
    _, log = run_peer(tmp_path, "wrong", wrong, [], ok=False)
    assert "refused the connection" in log and "AuthenticationError" in log
    assert "redis://:***@127.0.0.1" in log
    assert "not-the-pw-77" not in log and PASSWORD not in log


def test_tls_url_end_to_end(tmp_path: Path) -> None:
    tls = write_tls_files(tmp_path / "tls")
    with running_redis(tmp_path / "redis-tls", password=PASSWORD, tls=tls) as url:
        assert url.startswith("rediss://")
        tokens = list(range(7000, 7040))
        got, log = run_peer(tmp_path, "tls", url, [
            store_op(tmp_path, "t", tokens, 5),
            {"kind": "fetch", "name": "f", "tokens": tokens}])
        assert got is not None and got["t"] == 40 and got["f"] == 40
        assert torch.equal(got["f.kv"], random_kv(40, 5))
        assert all(0 < t <= TTL_S for t in ttls(redis.Redis.from_url(url),
                                                 got["t.keys"]).values())
        assert PASSWORD not in log
        # the TLS port speaks no plaintext: a redis:// URL to it is refused at start-up
        plain = url.replace("rediss://", "redis://").split("?")[0]
        _, log = run_peer(tmp_path, "plain", plain, [], ok=False)
        assert "refused the connection" in log and PASSWORD not in log
