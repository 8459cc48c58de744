"""LMCache's Redis writes get a socket timeout sized for a whole prompt's batch of SETs."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

import redis

from worker.lmcache_engine import PUT_SOCKET_TIMEOUT_S, lmcache_remote_url


def test_redis_urls_get_write_and_connect_timeouts() -> None:
    url = lmcache_remote_url("redis://:s3cret@127.0.0.1:6380/2")
    q = parse_qs(urlsplit(url).query)
    assert q == {"socket_timeout": [str(PUT_SOCKET_TIMEOUT_S)], "socket_connect_timeout": ["5.0"]}
    assert url.startswith("redis://:s3cret@127.0.0.1:6380/2?")
    # what LMCache's connector does with it: redis-py's pool reads both as seconds
    kw = redis.ConnectionPool.from_url(url).connection_kwargs
    assert kw["socket_timeout"] == PUT_SOCKET_TIMEOUT_S and kw["socket_connect_timeout"] == 5.0
    assert kw["password"] == "s3cret" and kw["db"] == 2


def test_an_operators_own_timeout_is_kept() -> None:
    url = lmcache_remote_url("rediss://h:1/0?socket_timeout=42&ssl_cert_reqs=none")
    q = parse_qs(urlsplit(url).query)
    assert q["socket_timeout"] == ["42"] and q["ssl_cert_reqs"] == ["none"]
    assert q["socket_connect_timeout"] == ["5.0"]


def test_other_stores_are_left_alone() -> None:
    assert lmcache_remote_url("lm://127.0.0.1:65000") == "lm://127.0.0.1:65000"


def test_only_a_writer_gets_the_whole_staging_as_lmcaches_pool() -> None:
    from worker.kv_store_config import KVStoreConfig
    from worker.lmcache_engine import lmcache_pool_gb

    def cfg(url: str) -> KVStoreConfig:
        # Llama-3-8B bf16: 131,072 B a token, blocks of 16, chunks of 256
        return KVStoreConfig(url=url, model_name="m", engine_layout="x", block_size=16,
                             bytes_per_block=16 * 131072, chunk_size=256, staging_gb=17.0)

    assert lmcache_pool_gb(cfg("redis://h:1"), writes=True) == 17.0
    # a reader of Redis never enters LMCache's pool: two chunks (64 MiB) instead of 17 GiB
    assert lmcache_pool_gb(cfg("redis://h:1"), writes=False) == 2 * 256 * 131072 / 2**30
    # an lm:// store is read through LMCache's own retrieve, which needs the pool
    assert lmcache_pool_gb(cfg("lm://h:1"), writes=False) == 17.0
