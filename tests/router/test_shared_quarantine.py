"""The quarantine shared through Redis (router/shared_quarantine.py), against a real
redis-server: routers on one Redis refuse each other's quarantined requests, entries expire,
and a Redis that is down or hung never slows or fails a request."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from pathlib import Path

import grpc
import openai
import pytest
import redis

from router.quarantine import Quarantine, request_fingerprint
from router.shared_quarantine import KEY_PREFIX, SharedQuarantine, quarantine_key
from tests.helpers.redis_server import running_redis
from tests.router.conftest import MODEL, start_cluster
from tests.router.router_fakes import CRASHED, LoopThread, TinyTokenizer

pytestmark = pytest.mark.timeout(60)

LOGGER = "bulkhead.router.quarantine"
PROMPT = [101, 2023, 2003, 1037, 3231]
FP = request_fingerprint(MODEL, PROMPT)
LONG_PROMPT = "Hello world! The quick brown fox jumps over the lazy dog. " * 4  # split route


def shared(url: str, ttl_s: float = 30.0, clock=time.monotonic) -> SharedQuarantine:
    return SharedQuarantine(Quarantine(ttl_s=ttl_s, clock=clock), url)


async def test_a_fingerprint_quarantined_on_one_router_is_refused_by_another(r, redis_url):
    a, b = shared(redis_url), shared(redis_url)
    try:
        assert not await b.contains(FP)
        a.add(FP)
        assert a.local.contains(FP)       # locally at once, before Redis answers
        await a.aclose()                  # the write has landed
        assert await b.contains(FP)
        # the key holds the fingerprint only, with the quarantine's TTL
        assert await r.keys("*") == [quarantine_key(FP).encode()]
        assert await r.get(quarantine_key(FP)) == b"1"
        assert 0 < await r.pttl(quarantine_key(FP)) <= 30_000
        # b keeps the hit in memory: it no longer needs Redis for it
        await r.flushdb()
        assert await b.contains(FP)
        assert not await b.contains(request_fingerprint(MODEL, PROMPT[:-1]))
    finally:
        await a.aclose()
        await b.aclose()


async def test_an_entry_expires_in_redis_after_the_ttl(r, redis_url):
    a, b = shared(redis_url, ttl_s=0.3), shared(redis_url)
    try:
        a.add(FP)
        await a.aclose()
        assert 0 < await r.pttl(quarantine_key(FP)) <= 300
        await asyncio.sleep(0.4)
        assert not await b.contains(FP)
        assert not a.local.contains(FP)
    finally:
        await b.aclose()


async def test_a_hit_from_redis_is_kept_only_for_the_ttl_left(r, redis_url):
    now = [1000.0]
    b = shared(redis_url, ttl_s=600.0, clock=lambda: now[0])
    try:
        # another router quarantined it 595 s ago: 5 s are left
        await r.set(quarantine_key(FP), b"1", px=5_000)
        assert await b.contains(FP)
        await r.delete(quarantine_key(FP))
        now[0] += 4.0
        assert await b.contains(FP)       # from memory
        now[0] += 2.0
        assert not await b.contains(FP)   # not for b's own 600 s
    finally:
        await b.aclose()


async def test_redis_stopped_means_local_answers_at_once(tmp_path: Path, caplog):
    other = request_fingerprint(MODEL, PROMPT[::-1])
    with running_redis(tmp_path, maxmemory_mb=64) as url:
        q = shared(url)
        q.add(FP)
        await asyncio.sleep(0)
        assert not await q.contains(other)  # connected and answering
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            started = time.monotonic()
            assert await q.contains(FP)
            assert not await q.contains(other)
            assert not await q.contains(other)
            q.add(other)                          # does not raise
            await q.aclose()                      # the failed write ends too
            assert time.monotonic() - started < 1.0
        assert await q.contains(other)          # kept locally
        assert caplog.text.count("unreachable") == 1
    finally:
        await q.aclose()


async def test_a_hung_redis_costs_a_request_at_most_the_timeout(caplog):
    # accepts connections (the kernel's backlog) and never answers
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(8)
        q = shared(f"redis://127.0.0.1:{hung.getsockname()[1]}")
        try:
            with caplog.at_level(logging.WARNING, logger=LOGGER):
                started = time.monotonic()
                assert not await q.contains(FP)
                assert time.monotonic() - started < 1.0
                started = time.monotonic()
                assert not await q.contains(FP)   # no second wait while it is known down
                assert time.monotonic() - started < 0.1
                q.add(FP)
                assert await q.contains(FP)
            assert "unreachable" in caplog.text
        finally:
            started = time.monotonic()
            await q.aclose()
            assert time.monotonic() - started < 1.0


async def test_without_a_url_it_is_the_local_quarantine():
    q = SharedQuarantine(Quarantine(ttl_s=30.0))
    assert not await q.contains(FP)
    q.add(FP)
    assert await q.contains(FP)
    await q.aclose()


def test_two_routers_on_one_redis_refuse_what_killed_workers_behind_either(
        loop_thread: LoopThread, tok: TinyTokenizer, redis_url: str) -> None:
    """Router A's prefill worker dies under a request, the only one it ran, and A quarantines
    it; router B, whose workers are fine, answers the same request 500 without sending it to
    any worker."""
    sync = redis.Redis.from_url(redis_url)
    sync.flushdb()
    a = start_cluster(loop_thread, tok, num_prefill=2, registry_url=redis_url)
    b = start_cluster(loop_thread, tok, num_prefill=1, registry_url=redis_url)
    try:
        for w in a.prefill:  # whichever it goes to dies under it
            w.prefill_error = grpc.StatusCode.UNAVAILABLE
            w.prefill_error_details = CRASHED
        with pytest.raises(openai.InternalServerError) as e:
            a.client().completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=5)
        assert "quarantined" in str(e.value)
        deadline = time.monotonic() + 5.0
        while not sync.keys(KEY_PREFIX + "*") and time.monotonic() < deadline:
            time.sleep(0.02)
        keys = sync.keys(KEY_PREFIX + "*")
        assert len(keys) == 1 and b"Hello" not in keys[0] and sync.get(keys[0]) == b"1"
        with pytest.raises(openai.InternalServerError) as e:
            b.client().completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=5)
        assert "quarantined" in str(e.value)
        assert b.prefill[0].prefills == [] and b.decode[0].generates == []
        r = b.client().completions.create(model=MODEL, prompt=LONG_PROMPT + " more", max_tokens=5)
        assert r.choices[0].text
    finally:
        a.close()
        b.close()
        sync.close()
