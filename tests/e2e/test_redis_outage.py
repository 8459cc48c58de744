"""The KV store goes away and comes back (real processes, a real redis-server killed and
restarted on its port): while it is down, long prompts are still answered correctly and without
waiting out the KV-visibility timeout (the decode worker recomputes); once it is back, the
handoff loads KV again by itself."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from launch.launcher import spawn, tcp_open, wait_until
from tests.e2e.conftest import E2E, deploy
from tests.e2e.test_tiny_deployment import complete_ids, token_prompt
from tests.helpers.tiny_model import hf_greedy


@pytest.fixture(scope="module")
def outage(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2E]:
    yield from deploy(tmp_path_factory)


def _loaded(e2e: E2E) -> float:
    return e2e.metric("bulkhead_prompt_tokens_total", source="loaded")


def test_requests_survive_a_redis_outage_and_the_handoff_recovers(outage: E2E) -> None:
    e2e = outage
    dep = e2e.deployment
    redis = next(p for p in dep.group.processes if p.name == "redis")
    prompt = token_prompt(90, seed=21)
    before = _loaded(e2e)
    assert complete_ids(e2e, prompt, 6, stream=False)[0] == hf_greedy(e2e.folder, prompt, 6)
    assert _loaded(e2e) == before + len(prompt)  # the handoff works

    redis.popen.send_signal(signal.SIGKILL)
    redis.popen.wait(10)
    down = token_prompt(95, seed=22)
    started = time.monotonic()
    ids, _ = complete_ids(e2e, down, 6, stream=False)
    assert ids == hf_greedy(e2e.folder, down, 6)  # recomputed, still right
    assert time.monotonic() - started < 8  # not held for the visibility timeout

    # Redis comes back on the same port, empty: the next handoffs load KV again.
    url = urlsplit(dep.kv_store_url)
    back = spawn("redis-again", [*redis.argv], log_dir=dep.log_dir)
    dep.group.add(back)
    wait_until(back, lambda: tcp_open(url.hostname, url.port), 15, "listening")
    again = token_prompt(100, seed=23)
    deadline = time.monotonic() + 30
    while True:
        before = _loaded(e2e)
        assert complete_ids(e2e, again, 6, stream=False)[0] == hf_greedy(e2e.folder, again, 6)
        if _loaded(e2e) > before or time.monotonic() > deadline:
            break
        again = [t + 1 for t in again]  # a fresh prompt: nothing of it is stored yet
    assert _loaded(e2e) > before, "the KV handoff did not recover after Redis came back"
