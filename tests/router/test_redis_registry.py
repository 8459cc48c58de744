"""The Redis worker registry, router side (router/redis_registry.py), against a real redis-server
and real gRPC servers: WorkerInfo is published into Redis directly, as worker/registration.py
does, so each test controls the heartbeat exactly."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis.asyncio as aioredis
from fastapi.testclient import TestClient

from common.worker_registry import worker_key
from launch.launcher import redis_server_path, start_redis
from proto import bulkhead_pb2 as pb
from proto import bulkhead_pb2_grpc as pb_grpc
from router.app import create_app
from router.redis_registry import RedisRegistry
from router.registry import MAX_MISSED_POLLS
from router.settings import RouterSettings
from router.worker_client import CallDeadlines
from tests.router.router_fakes import COMPAT, SCRIPT, FakeWorker, TinyTokenizer, start_worker

pytestmark = pytest.mark.timeout(60)

DEADLINES = CallDeadlines(0.3, 5.0, 5.0, 5.0)
LOGGER = "bulkhead.router.registry"


class InfoWorker(pb_grpc.WorkerServicer):
    """Answers GetInfo with `info` (mutable), `delay_s` late: a worker whose load and progress
    counters the test sets."""

    def __init__(self, role: str, **compat: Any) -> None:
        self.info = pb.WorkerInfo(role=role, model_name="tiny", max_context=512, max_batch=4,
                                  max_queue=8, free_kv_tokens=4096)
        self.info.compat.CopyFrom(COMPAT)
        for name, value in compat.items():
            setattr(self.info.compat, name, value)
        self.delay_s = 0.0
        self.server: grpc.aio.Server | None = None

    async def GetInfo(self, request: Any, context: Any) -> pb.WorkerInfo:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return self.info

    async def start(self, worker_id: str) -> InfoWorker:
        self.server = grpc.aio.server()
        pb_grpc.add_WorkerServicer_to_server(self, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.info.address = f"127.0.0.1:{port}"
        self.info.worker_id = worker_id
        return self

    @property
    def key(self) -> str:
        return worker_key(self.info.role, self.info.worker_id)


@pytest.fixture
async def workers() -> AsyncIterator[list[InfoWorker]]:
    made: list[InfoWorker] = []
    yield made
    for w in made:
        assert w.server is not None
        await w.server.stop(0)


async def publish(r: aioredis.Redis, w: InfoWorker, ttl_s: float = 10.0) -> None:
    await r.set(w.key, w.info.SerializeToString(), px=int(ttl_s * 1000))


def make_registry(url: str, **kw: Any) -> RedisRegistry:
    return RedisRegistry(kw.pop("prefill", ()), kw.pop("decode", ()), DEADLINES, 3600.0,
                         kw.pop("stall_timeout_s", 120.0), registry_url=url, **kw)


@contextlib.asynccontextmanager
async def registry(url: str, **kw: Any) -> AsyncIterator[RedisRegistry]:
    """make_registry's registry, stopped however the test ends."""
    reg = make_registry(url, **kw)
    try:
        yield reg
    finally:
        await reg.stop()


def healthy(reg: RedisRegistry) -> dict[str, bool]:
    return {w.address: w.healthy for w in reg.loads()}


async def test_a_published_worker_is_discovered_and_polled(r, redis_url, workers) -> None:
    decode = await InfoWorker("decode").start("decode-0")
    workers.append(decode)
    await publish(r, decode)
    reg = make_registry(redis_url)
    await reg.start()
    try:
        assert healthy(reg) == {decode.info.address: True}
        assert reg.info(decode.info.address).worker_id == "decode-0"
        assert (await reg.client(decode.info.address).get_info()).role == "decode"
        # a second worker registering later is picked up by the next scan
        prefill = await InfoWorker("prefill").start("prefill-0")
        workers.append(prefill)
        await publish(r, prefill)
        await reg.refresh()
        assert healthy(reg) == {decode.info.address: True, prefill.info.address: True}
        assert reg.problems() == {}
    finally:
        await reg.stop()


async def test_an_expired_key_drops_the_worker(r, redis_url, workers, caplog) -> None:
    decode = await InfoWorker("decode").start("decode-short")
    workers.append(decode)
    await publish(r, decode, ttl_s=1.0)
    async with registry(redis_url) as reg:
        await reg.refresh()
        assert healthy(reg) == {decode.info.address: True}
        await asyncio.sleep(1.3)  # no heartbeat: the key expires although GetInfo still answers
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            await reg.refresh()
        assert reg.loads() == [] and reg.info(decode.info.address) is None
        assert f"worker {decode.info.address} (decode) dropped" in caplog.text
        assert "expired" in caplog.text
        # the same worker publishing again registers again
        await publish(r, decode)
        await reg.refresh()
        assert healthy(reg) == {decode.info.address: True}


@pytest.mark.parametrize(("field", "value", "expected"), [
    ("block_size", 8, "block_size: 8 != 16"),
    ("model_fingerprint", "m2", "model_fingerprint: 'm2' != 'm1'"),
])
async def test_an_incompatible_worker_is_refused_at_registration(
        r, redis_url, workers, caplog, field: str, value: Any, expected: str) -> None:
    decode = await InfoWorker("decode").start("decode-ref")
    odd = await InfoWorker("prefill", **{field: value}).start("prefill-odd")
    good = await InfoWorker("prefill").start("prefill-good")
    workers.extend([decode, odd, good])
    await publish(r, decode)
    async with registry(redis_url) as reg:
        await reg.refresh()
        await publish(r, odd)
        await publish(r, good)
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            await reg.refresh()
            await reg.refresh()  # refused again, but logged once
        lines = [rec.getMessage() for rec in caplog.records if "refused" in rec.getMessage()]
        assert len(lines) == 1, lines
        assert lines[0].startswith(f"worker prefill-odd refused: {expected}")
        assert decode.info.address in lines[0]  # names the reference it was compared with
        assert healthy(reg) == {decode.info.address: True, good.info.address: True}
        assert reg.problems()[odd.info.address].startswith(f"refused at registration: {expected}")


async def test_a_worker_with_another_tokenizer_than_the_router_is_refused(
        r, redis_url, workers, caplog) -> None:
    decode = await InfoWorker("decode", tokenizer_fingerprint="t-other").start("decode-tok")
    workers.append(decode)
    await publish(r, decode)
    async with registry(redis_url, expected_tokenizer_fingerprint="t1") as reg:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            await reg.refresh()
        assert reg.loads() == []
        assert ("worker decode-tok refused: tokenizer_fingerprint: 't-other' != 't1'"
                in caplog.text)


async def test_a_stalled_worker_with_work_is_not_routed_to(r, redis_url, workers) -> None:
    decode = await InfoWorker("decode").start("decode-stall")
    workers.append(decode)
    decode.info.num_running, decode.info.steps_completed = 1, 5
    await publish(r, decode)
    async with registry(redis_url, stall_timeout_s=0.4) as reg:
        await reg.refresh()
        assert healthy(reg) == {decode.info.address: True}
        await asyncio.sleep(0.5)
        await reg.refresh()  # GetInfo answers at once, but the counters stand still
        assert healthy(reg) == {decode.info.address: False}
        assert "stalled" in reg.problems()[decode.info.address]
        decode.info.steps_completed += 1
        decode.info.tokens_advanced += 16
        await reg.refresh()
        assert healthy(reg) == {decode.info.address: True}


async def test_a_long_prefill_with_slow_getinfo_stays_healthy_while_steps_complete(
        r, redis_url, workers) -> None:
    prefill = await InfoWorker("prefill").start("prefill-busy")
    workers.append(prefill)
    prefill.info.num_running = 1
    await publish(r, prefill)
    async with registry(redis_url, stall_timeout_s=0.5) as reg:
        await reg.refresh()
        prefill.delay_s = 1.0  # every GetInfo misses its 0.3 s deadline from now on
        started = time.monotonic()
        for _ in range(MAX_MISSED_POLLS + 2):
            prefill.info.steps_completed += 1  # one prefill chunk per heartbeat
            prefill.info.tokens_advanced += 4096
            await publish(r, prefill)
            await reg.refresh()
            assert healthy(reg) == {prefill.info.address: True}
        assert time.monotonic() - started > 0.5  # longer than the stall timeout
        # the same slow worker whose heartbeat shows no progress is stalled
        await asyncio.sleep(0.6)
        await reg.refresh()
        assert healthy(reg) == {prefill.info.address: False}
        assert "stalled" in reg.problems()[prefill.info.address]


async def test_frozen_after_an_idle_heartbeat_is_still_a_stall(r, redis_url, workers) -> None:
    """The heartbeat was written while the worker was idle; a later GetInfo saw it busy; then
    it froze (no answer, no heartbeat). The later observation decides: it has work and its
    counters stand still, so it is stalled (the idle heartbeat alone would say alive)."""
    decode = await InfoWorker("decode").start("decode-frozen")
    workers.append(decode)
    await publish(r, decode)   # idle heartbeat
    async with registry(redis_url, stall_timeout_s=0.4) as reg:
        decode.info.num_running, decode.info.steps_completed = 2, 9
        await reg.refresh()    # GetInfo: busy, advancing
        assert healthy(reg) == {decode.info.address: True}
        decode.delay_s = 1.0   # frozen: every GetInfo misses its deadline
        for _ in range(4):
            await asyncio.sleep(0.3)
            await reg.refresh()
            if not healthy(reg)[decode.info.address]:
                break
        assert healthy(reg) == {decode.info.address: False}
        assert "stalled" in reg.problems()[decode.info.address]


async def test_a_dead_worker_is_out_before_its_key_expires(r, redis_url, workers) -> None:
    decode = await InfoWorker("decode").start("decode-dead")
    await publish(r, decode)
    async with registry(redis_url) as reg:
        await reg.refresh()
        assert decode.server is not None
        await decode.server.stop(0)  # killed: the key lives on, the connection is refused
        await reg.refresh()
        assert healthy(reg) == {decode.info.address: False}


async def test_static_addresses_are_merged_and_never_dropped(r, redis_url, workers) -> None:
    static = await InfoWorker("decode").start("decode-static")
    registered = await InfoWorker("prefill").start("prefill-reg")
    workers.extend([static, registered])
    await publish(r, static, ttl_s=1.0)   # the static worker registering too changes nothing
    await publish(r, registered)
    async with registry(redis_url, decode=[static.info.address]) as reg:
        await reg.refresh()
        assert healthy(reg) == {static.info.address: True, registered.info.address: True}
        await asyncio.sleep(1.2)
        await reg.refresh()
        assert healthy(reg) == {static.info.address: True, registered.info.address: True}


async def test_a_dropped_worker_keeps_its_channel_while_a_request_uses_it(
        r, redis_url, workers) -> None:
    decode = await InfoWorker("decode").start("decode-inflight")
    workers.append(decode)
    await publish(r, decode)
    async with registry(redis_url) as reg:
        await reg.refresh()
        addr = decode.info.address
        with reg.track(addr):
            await r.delete(decode.key)  # graceful stop: the worker deleted its key
            await reg.refresh()
            assert reg.loads() == []
            assert (await reg.client(addr).get_info()).worker_id == "decode-inflight"
            reg.mark_unavailable(addr, "UNAVAILABLE")  # a late failure report is harmless
        await reg.refresh()
        with pytest.raises(KeyError):
            reg.client(addr)


async def test_redis_outage_and_restart_drop_nobody(tmp_path: Path, workers, caplog) -> None:
    if redis_server_path() is None:
        pytest.skip("redis-server is not installed")
    proc, url = start_redis(log_dir=tmp_path, maxmemory_mb=64)
    decode = await InfoWorker("decode").start("decode-outage")
    workers.append(decode)
    client = aioredis.from_url(url)
    reg = make_registry(url)
    try:
        await publish(client, decode)
        await reg.refresh()
        proc.stop(grace_s=5.0)
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            await reg.refresh()
            await reg.refresh()
        assert healthy(reg) == {decode.info.address: True}
        assert caplog.text.count("unreachable") == 1
        # back on the same port, empty: the worker is kept until it publishes again
        port = int(url.rsplit(":", 1)[1])
        proc, _ = start_redis(port, log_dir=tmp_path, maxmemory_mb=64)
        await reg.refresh()
        await reg.refresh()
        assert healthy(reg) == {decode.info.address: True}
        await client.aclose()
        client = aioredis.from_url(url)  # the old connection died with the old server
        await publish(client, decode)
        await reg.refresh()
        assert healthy(reg) == {decode.info.address: True}
        assert reg._workers[decode.info.address].key == decode.key
    finally:
        await reg.stop()
        await client.aclose()
        proc.stop(grace_s=5.0)


def test_the_app_discovers_workers_in_redis_and_serves_through_them(redis_url, caplog) -> None:
    """create_app with registry_url: a registered decode worker serves a request; an
    incompatible prefill worker is refused and /health says why."""
    tok = TinyTokenizer()
    script = tok.encode(SCRIPT, add_special_tokens=False)
    loop = asyncio.new_event_loop()
    decode = FakeWorker("decode", script, tok.eos_token_ids[0])
    odd = FakeWorker("prefill", script, tok.eos_token_ids[0])
    odd.compat.lmcache_chunk_size = 128
    servers = [loop.run_until_complete(start_worker(w)) for w in (decode, odd)]

    async def publish_all() -> None:
        client = aioredis.from_url(redis_url)
        await client.flushdb()
        for w, wid in ((decode, "d0"), (odd, "p0")):
            info = await w.GetInfo(None, None)
            await client.set(worker_key(w.role, wid), info.SerializeToString(), px=10_000)
        await client.aclose()

    import threading

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(publish_all(), loop).result(10)
        settings = RouterSettings(model="unused", served_model_name="tiny",
                                  registry_url=redis_url, poll_interval_s=0.2)
        with caplog.at_level(logging.WARNING, logger=LOGGER), \
                TestClient(create_app(settings, tokenizer=tok)) as http:
            health = http.get("/health").json()
            assert health["status"] == "ok"
            assert health["workers"][decode.address]["healthy"] is True
            problem = health["workers"][odd.address]["problem"]
            assert problem.startswith("refused at registration: lmcache_chunk_size: 128 != 256")
            resp = http.post("/v1/completions", json={
                "model": "tiny", "prompt": "The answer", "max_tokens": 4, "temperature": 0})
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["text"] == tok.decode(script[:4])
            assert decode.generates and not odd.prefills
        # the fake's worker_id is its address
        assert f"worker {odd.address} refused: lmcache_chunk_size: 128 != 256" in caplog.text
    finally:
        for s in servers:
            asyncio.run_coroutine_threadsafe(s.stop(0), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
