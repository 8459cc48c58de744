"""The Redis worker registry, worker side (worker/registration.py), against a real
redis-server: the publisher keeps WorkerInfo under its key with a TTL, survives Redis being down,
deletes the key on stop; and a real `bulkhead decode` process registers, publishes its progress
counters, is discovered by the router's RedisRegistry, and deletes its key on SIGTERM."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import sys
import time
from pathlib import Path

import grpc
import pytest
import redis
import redis.asyncio as aioredis

from common.settings import WorkerSettings
from common.worker_env import WORKER_ENV
from common.worker_registry import worker_key
from launch.health import grpc_serving
from launch.launcher import free_port, redis_server_path, spawn, start_redis, wait_until
from proto import bulkhead_pb2 as pb
from proto import bulkhead_pb2_grpc as pb_grpc
from router.redis_registry import RedisRegistry
from router.worker_client import CallDeadlines
from tests.helpers.startup_budget import startup_budget_s
from worker.registration import RegistrationPublisher, registration_publisher

pytestmark = pytest.mark.timeout(120)

LOGGER = "worker.registration"


def info(steps: int) -> pb.WorkerInfo:
    return pb.WorkerInfo(worker_id="decode-t", role="decode", address="127.0.0.1:1",
                         steps_completed=steps, tokens_advanced=steps * 16)


async def test_publishes_with_ttl_refreshes_and_deletes_on_stop(redis_url: str) -> None:
    steps = [0]
    key = worker_key("decode", "decode-t")
    pub = RegistrationPublisher(redis_url, key, lambda: info(steps[0]), ttl_s=0.6)
    client = aioredis.from_url(redis_url)
    try:
        await pub.start()
        got = pb.WorkerInfo.FromString(await client.get(key))
        assert got.worker_id == "decode-t" and got.steps_completed == 0
        assert 0 < await client.pttl(key) <= 600
        steps[0] = 7
        deadline = time.monotonic() + 3
        while pb.WorkerInfo.FromString(await client.get(key)).steps_completed != 7:
            assert time.monotonic() < deadline, "the heartbeat did not publish new counters"
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # longer than the TTL: the beats keep the key alive
        assert await client.exists(key) and pub.num_published >= 4
        await pub.stop()
        assert not await client.exists(key)
    finally:
        await pub.stop()
        await client.aclose()


async def test_redis_down_is_logged_once_and_the_heartbeat_recovers(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    if redis_server_path() is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    url = f"redis://127.0.0.1:{port}"
    key = worker_key("decode", "decode-t")
    pub = RegistrationPublisher(url, key, lambda: info(1), ttl_s=0.3)
    proc = None
    try:
        with caplog.at_level(logging.INFO, logger=LOGGER):
            await pub.start()  # nothing listens: start still returns
            await asyncio.sleep(0.5)  # several failed beats
            assert pub.num_published == 0
            failures = [r for r in caplog.records if "unreachable" in r.getMessage()]
            assert len(failures) == 1 and "still serving" in failures[0].getMessage()
            proc, _ = start_redis(port, log_dir=tmp_path, maxmemory_mb=32)
            client = redis.Redis.from_url(url)
            deadline = time.monotonic() + 5
            while not client.exists(key):
                assert time.monotonic() < deadline, "the publisher did not recover"
                await asyncio.sleep(0.05)
            client.close()
        assert any("registered as" in r.getMessage() for r in caplog.records)
    finally:
        await pub.stop()
        if proc is not None:
            proc.stop(grace_s=5.0)


def test_settings_make_the_publisher() -> None:
    base = WorkerSettings(role="decode", port=50999, worker_id="d-7")
    assert registration_publisher(base, "decode", lambda: info(0)) is None
    pub = registration_publisher(
        dataclasses.replace(base, registry_url="redis://:secret@127.0.0.1:6379/2",
                            heartbeat_ttl_s=4.5), "decode", lambda: info(0))
    assert pub is not None and pub.key == "bulkhead:worker:decode:d-7"
    assert pub.ttl_s == 4.5 and pub.interval_s == 1.5
    assert "secret" not in repr(dataclasses.replace(base, registry_url="redis://:secret@h:1"))
    with pytest.raises(ValueError, match="registry_url"):
        RegistrationPublisher("http://127.0.0.1:6379", "k", lambda: info(0))


async def test_a_real_worker_registers_reports_progress_and_deregisters(
        redis_url: str, tmp_path: Path) -> None:
    from tests.helpers.tiny_model import write_tiny_llama

    model = write_tiny_llama(tmp_path / "tiny")
    port = free_port()
    address = f"127.0.0.1:{port}"
    argv = [sys.executable, "-m", "launch.cli", "decode", "--model", str(model), "--port",
            str(port), "--device", "cpu", "--max-context", "256", "--chunk-tokens", "32",
            "--max-batch", "2", "--block-size", "16", "--attn-tile-tokens", "64",
            "--num-threads", "1", "--worker-id", "decode-real", "--registry-url", redis_url,
            "--heartbeat-ttl-s", "6", "--grace-s", "1"]
    proc = spawn("decode", argv, env=WORKER_ENV, log_dir=tmp_path)
    key = worker_key("decode", "decode-real")
    client = redis.Redis.from_url(redis_url)
    reg = RedisRegistry((), (), CallDeadlines(2.0, 5.0, 5.0, 5.0), 3600.0,
                        registry_url=redis_url)
    try:
        wait_until(proc, lambda: grpc_serving(address), startup_budget_s(2 / 3),
                   f"serving on {address}")
        wait_until(proc, lambda: bool(client.exists(key)), 10, "registered")
        published = pb.WorkerInfo.FromString(client.get(key))
        assert published.address == address and published.role == "decode"
        assert len(published.compat.model_fingerprint) == 64 and published.compat.block_size == 16
        before = published.tokens_advanced

        await reg.refresh()
        assert [(w.address, w.healthy) for w in reg.loads()] == [(address, True)]

        with grpc.insecure_channel(address) as ch:
            req = pb.GenerateRequest(prompt_token_ids=list(range(4, 40)),
                                     sampling=pb.SamplingParams(max_tokens=5, temperature=0.0))
            assert sum(len(c.token_ids) for c in pb_grpc.WorkerStub(ch).Generate(
                req, timeout=60)) == 5
        # the engine's progress counters reach the heartbeat within one interval (2 s)
        wait_until(proc, lambda: pb.WorkerInfo.FromString(client.get(key)).tokens_advanced
                   >= before + 36 + 4, 6, "progress published")

        remaining_ms = client.pttl(key)
        assert remaining_ms > 3000
        started = time.monotonic()
        proc.popen.send_signal(signal.SIGTERM)
        assert proc.popen.wait(timeout=30) == 0, proc.log_tail()
        assert time.monotonic() - started < remaining_ms / 1000  # it had not expired yet
        assert not client.exists(key), "a graceful stop deletes the registry key"
        await reg.refresh()
        assert reg.loads() == []
    finally:
        await reg.stop()
        proc.stop(grace_s=5.0)
        client.close()
