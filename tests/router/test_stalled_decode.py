"""A decode worker that stops advancing (its engine frozen: GetInfo still answers, the counters
stand still, no token comes) under load: its streams fail within stall_timeout_s instead of
waiting out stream_idle_timeout_s, choices that had no token yet fail over to the other decode
worker, and /health names the stall; once it advances again it is routed to again."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.router.conftest import MODEL, Cluster, start_cluster
from tests.router.router_fakes import LoopThread, TinyTokenizer

STALL_S = 1.0
ASK = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def cluster(loop_thread: LoopThread, tok: TinyTokenizer) -> Iterator[Cluster]:
    c = start_cluster(loop_thread, tok, num_decode=2, stall_timeout_s=STALL_S,
                      poll_interval_s=0.2, stream_idle_timeout_s=60.0,
                      split_threshold_tokens=10_000)  # every choice on the decode route
    for w in c.decode:
        w.token_delay_s = 0.05
    yield c
    c.close()


def _health(c: Cluster) -> dict:
    with c.http() as h:
        return h.get("/health").json()["workers"]


def test_a_stream_on_a_frozen_worker_fails_fast(cluster: Cluster) -> None:
    client = cluster.client(timeout=30.0)
    got = ""
    started = None
    with pytest.raises(openai.APIError) as exc:
        for chunk in client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200,
                                                     stream=True,
                                                     extra_body={"ignore_eos": True}):
            got += (chunk.choices[0].delta.content or "") if chunk.choices else ""
            if got and started is None:   # tokens came: the engine freezes mid-stream
                started = time.monotonic()
                for w in cluster.decode:
                    w.frozen = True
    assert started is not None
    elapsed = time.monotonic() - started
    assert elapsed < STALL_S + 5, elapsed   # not the 60 s stream-idle deadline
    assert "stopped advancing" in str(exc.value), exc.value
    problems = [w.get("problem", "") for w in _health(cluster).values()]
    assert any("stalled" in p or "stopped advancing" in p for p in problems), problems


def test_choices_without_a_token_fail_over(cluster: Cluster) -> None:
    stalled, ok = cluster.decode
    stalled.frozen = True
    client = cluster.client(timeout=30.0)

    def one(i: int) -> tuple[str, float]:
        t0 = time.monotonic()
        r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8)
        return r.choices[0].finish_reason, time.monotonic() - t0

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(4)))
    assert [r for r, _ in results] == ["length"] * 4
    assert max(t for _, t in results) < STALL_S + 5
    assert stalled.generates, "no request reached the frozen worker: nothing was tested"
    assert len(ok.completed) == 4
    # its choices were cancelled, so it has no work left: idle, it is routed to again (a real
    # frozen engine keeps reporting them until it resumes, and stays out: the test above)
    stalled.frozen = False
    deadline = time.monotonic() + 10
    while "problem" in _health(cluster)[stalled.address]:
        assert time.monotonic() < deadline, _health(cluster)
        time.sleep(0.1)
