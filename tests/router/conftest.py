"""Fixtures: the real router app served by uvicorn on 127.0.0.1, in front of fake gRPC workers;
a real redis-server per module (``redis_url``) and an asyncio client on it, emptied (``r``)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
import redis.asyncio as aioredis
import uvicorn

from router.app import create_app
from router.settings import RouterSettings
from tests.helpers.redis_server import running_redis
from tests.router.router_fakes import SCRIPT, FakeWorker, LoopThread, TinyTokenizer, start_worker

MODEL = "tiny"


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_redis(tmp_path_factory.mktemp("redis"), maxmemory_mb=64) as url:
        yield url


@pytest.fixture
async def r(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(redis_url)
    await client.flushdb()
    try:
        yield client
    finally:
        await client.aclose()


@dataclass
class Cluster:
    base_url: str
    prefill: list[FakeWorker]
    decode: list[FakeWorker]
    loop: LoopThread
    tok: TinyTokenizer
    servers: list[Any] = field(default_factory=list)   # grpc.aio servers: prefill, then decode
    _stops: list[Callable[[], Any]] = field(default_factory=list)

    def client(self, **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=kw.pop("api_key", "unused"),
                             max_retries=0, timeout=kw.pop("timeout", 20.0), **kw)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=20.0)

    def healthy(self) -> bool:
        with self.http() as h:
            return h.get("/health").status_code == 200

    def router_inflight(self) -> float:
        """Sum of the router's in-flight counts over workers and requests (0 when idle)."""
        with self.http() as h:
            text = h.get("/metrics").text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith(("bulkhead_worker_router_inflight{",
                                       "bulkhead_router_requests_in_flight ")))

    def close(self) -> None:
        for stop in reversed(self._stops):
            stop()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@pytest.fixture(scope="session")
def tok() -> TinyTokenizer:
    return TinyTokenizer()


@pytest.fixture(scope="session")
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


def _bound_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def start_cluster(loop: LoopThread, tok: TinyTokenizer, *, num_prefill: int = 1,
                  num_decode: int = 1, worker_kw: dict[str, Any] | None = None,
                  extra_decode_addresses: tuple[str, ...] = (), model_path: str = "",
                  **settings_kw: Any) -> Cluster:
    """Fake workers plus the real router app; with `model_path` the app loads its own tokenizer
    from that folder (the production path) instead of being handed `tok`."""
    script = tok.encode(SCRIPT, add_special_tokens=False)
    eos = tok.eos_token_ids[0]
    kw = worker_kw or {}
    prefill = [FakeWorker("prefill", script, eos, **kw) for _ in range(num_prefill)]
    decode = [FakeWorker("decode", script, eos, **kw) for _ in range(num_decode)]
    servers = [loop.run(start_worker(w)) for w in prefill + decode]
    settings = RouterSettings(
        model=model_path or "unused", served_model_name=MODEL,
        prefill_workers=tuple(w.address for w in prefill),
        decode_workers=tuple(w.address for w in decode) + extra_decode_addresses,
        **{"split_threshold_tokens": 32, "poll_interval_s": 0.5, "info_timeout_s": 1.0,
           **settings_kw})
    app = create_app(settings, tokenizer=None if model_path else tok)
    sock = _bound_socket()
    server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning",
                                           timeout_graceful_shutdown=2))
    future = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), loop.loop)
    deadline = time.monotonic() + 15
    while not server.started:
        if future.done() or time.monotonic() > deadline:
            raise RuntimeError(f"router did not start: {future.exception() if future.done() else 'timeout'}")
        time.sleep(0.02)
    host, port = sock.getsockname()
    cluster = Cluster(f"http://{host}:{port}", prefill, decode, loop, tok, servers)

    def stop_router() -> None:
        server.should_exit = True
        future.result(timeout=15)
        sock.close()

    def stop_workers() -> None:
        for s in servers:
            loop.run(s.stop(grace=None))

    cluster._stops += [stop_workers, stop_router]
    return cluster


@pytest.fixture(scope="module")
def cluster(loop_thread: LoopThread, tok: TinyTokenizer) -> Iterator[Cluster]:
    c = start_cluster(loop_thread, tok)
    yield c
    c.close()


@pytest.fixture
def reset(cluster: Cluster) -> Cluster:
    """The module's cluster with the fakes' records cleared and misbehaviour switched off."""
    deadline = time.monotonic() + 3   # a stream's clean-up may finish just after its [DONE]
    while cluster.router_inflight() != 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert cluster.router_inflight() == 0, "a previous test left requests counted in flight"
    for w in cluster.prefill + cluster.decode:
        w.prefills.clear()
        w.generates.clear()
        w.aborts.clear()
        w.cancelled.clear()
        w.completed.clear()
        w.lookups = 0
        w.max_generating = 0
        w.num_cached = 0
        w.exhausted = False
        w.fail_after = -1
        w.token_delay_s = 0.0
        w.frozen = False
    return cluster
