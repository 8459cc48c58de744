"""A bounded load test of the whole split system (real processes, real redis-server): a few
hundred requests of mixed lengths, some over the planned context, some cancelled mid-stream.
Every request ends with a correct answer or a clear error, none hangs, and afterwards every
worker's KV blocks are free again (nothing leaked on any abort path) and every key in Redis
expires (KV chunks of cancelled or refused requests cannot pile up)."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
import redis

from common.settings import WorkerSettings
from proto import bulkhead_pb2 as pb
from proto import bulkhead_pb2_grpc as pb_grpc
from tests.e2e.conftest import E2E, MAX_CONTEXT

NUM_REQUESTS = 240
CONCURRENCY = 12


def _free_kv(address: str) -> tuple[int, int]:
    with grpc.insecure_channel(address) as ch:
        info = pb_grpc.WorkerStub(ch).GetInfo(pb.WorkerInfoRequest(), timeout=5)
    return int(info.free_kv_tokens), int(info.num_running + info.num_waiting)


def _keys_without_expiry(url: str) -> tuple[int, int, list[bytes]]:
    """(keys, LMCache chunk keys, keys with no TTL or one longer than kv_ttl_s) in the store."""
    client = redis.Redis.from_url(url)
    keys = list(client.scan_iter(count=1000))
    with client.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.ttl(key)
        ttls = pipe.execute()
    num_chunks = sum(k.endswith((b"kv_bytes", b"metadata")) for k in keys)
    # -2: expired between SCAN and TTL (fine); -1: no expiry (a leak)
    bad = [k for k, t in zip(keys, ttls, strict=True)
           if t == -1 or t > WorkerSettings().kv_ttl_s]
    return len(keys), num_chunks, bad


def _one(url: str, model: str, i: int) -> str:
    rnd = random.Random(i)
    kind = rnd.choice(["short", "short", "long", "over", "cancel"])
    n = {"short": rnd.randint(1, 30), "long": rnd.randint(60, 250),
         "over": MAX_CONTEXT + rnd.randint(0, 50), "cancel": rnd.randint(10, 200)}[kind]
    prompt = [rnd.randint(4, 300) for _ in range(n)]
    body = {"model": model, "prompt": prompt, "max_tokens": rnd.randint(1, 24),
            "temperature": rnd.choice([0.0, 0.8]), "seed": i}
    with httpx.Client(base_url=url, timeout=60) as h:
        if kind == "cancel":
            with h.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                for _ in r.iter_lines():
                    break  # the client goes away after the first event
            return "cancelled"
        r = h.post("/v1/completions", json=body)
        if kind == "over":
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "context_length_exceeded"
            return "refused"
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] in ("stop", "length")
        return "ok"


@pytest.mark.slow
def test_mixed_load_ends_every_request_and_leaks_nothing(e2e: E2E) -> None:
    dep = e2e.deployment
    workers = (dep.prefill_address, dep.decode_address)
    idle = {a: _free_kv(a)[0] for a in workers}
    started = time.monotonic()
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        outcomes = list(pool.map(lambda i: _one(dep.url, e2e.model, i), range(NUM_REQUESTS),
                                 timeout=600))
    elapsed = time.monotonic() - started
    assert len(outcomes) == NUM_REQUESTS
    assert {"ok", "refused", "cancelled"} <= set(outcomes)
    # aborted and finished requests give every block back (cancellations land asynchronously)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = {a: _free_kv(a) for a in workers}
        if all(now[a] == (idle[a], 0) for a in workers):
            break
        time.sleep(0.2)
    assert {a: _free_kv(a) for a in workers} == {a: (idle[a], 0) for a in workers}
    num_keys, num_chunk_keys, no_expiry = _keys_without_expiry(dep.kv_store_url)
    assert num_chunk_keys > 0, "no split request stored KV: the check below would prove nothing"
    assert not no_expiry, f"{len(no_expiry)} of {num_keys} Redis keys never expire: {no_expiry[:5]}"
    assert httpx.get(dep.url + "/health", timeout=5).status_code == 200
    print(f"\n{NUM_REQUESTS} requests in {elapsed:.1f} s: "
          + ", ".join(f"{k}={outcomes.count(k)}" for k in sorted(set(outcomes)))
          + f"; {num_keys} Redis keys, all expiring")
