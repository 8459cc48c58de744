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
