"""A starved decode worker, real processes: SIGSTOP/SIGCONT in short bursts (a host thrashing)
slows its streams but they complete; frozen for longer than stall_timeout_s mid-stream, its
streams end within stall_timeout_s plus a poll with an error naming the stall (not minutes of
stream-idle waits), /health reports it stalled, and once it runs again it serves again."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from launch.up import Deployment
from tests.helpers.stoppable_deployment import stoppable_deployment

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

STALL_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    router_args = ("--split-threshold-tokens", "100000",  # decode route
                   "--poll-interval-s", "0.5", "--stall-timeout-s", str(STALL_TIMEOUT_S),
                   "--stream-idle-timeout-s", "120")
    with stoppable_deployment(tmp_path_factory, router_args, 180) as d:
        yield d


def _decode_pid(d: Deployment) -> int:
    return next(p.pid for p in d.group.processes if p.argv[3:4] == ["decode"])


def _model(d: Deployment) -> str:
    return d.model_name


def _stream(d: Deployment, out: dict, max_tokens: int) -> None:
    body = {"model": _model(d), "messages": [{"role": "user", "content": "Count."}],
            "max_tokens": max_tokens, "stream": True, "temperature": 0, "ignore_eos": True}
    started = time.monotonic()
    try:
        with httpx.stream("POST", d.url + "/v1/chat/completions", json=body, timeout=300) as r:
            out["status"] = r.status_code
            out["events"] = events = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
    except BaseException as exc:  # reported by the test
        out["error"] = exc
    out["seconds"] = time.monotonic() - started


def _run(d: Deployment, n: int, max_tokens: int) -> tuple[list[dict], list[threading.Thread]]:
    outs: list[dict] = [{} for _ in range(n)]
    threads = [threading.Thread(target=_stream, args=(d, o, max_tokens), daemon=True)
               for o in outs]
    for t in threads:
        t.start()
    return outs, threads


def _errors(out: dict) -> list[dict]:
    return [json.loads(e)["error"] for e in out.get("events", []) if '"error"' in e]


def test_bursts_slow_the_streams_but_they_complete(deployment: Deployment) -> None:
    pid = _decode_pid(deployment)
    outs, threads = _run(deployment, 4, 60)
    deadline = time.monotonic() + 120
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        os.kill(pid, signal.SIGSTOP)   # a host thrashing: the worker runs a third of the time
        time.sleep(0.6)
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.3)
    for t in threads:
        t.join(10)
    for out in outs:
        assert out.get("status") == 200 and not _errors(out), out
        assert out["events"][-1] == "[DONE]"


def test_a_frozen_decode_worker_fails_fast_and_comes_back(deployment: Deployment) -> None:
    pid = _decode_pid(deployment)
    outs, threads = _run(deployment, 4, 360)   # the context is 384 tokens
    deadline = time.monotonic() + 60
    while not all(len(o.get("events", ())) >= 2 for o in outs):   # all four streaming
        assert time.monotonic() < deadline, outs
        time.sleep(0.02)
    os.kill(pid, signal.SIGSTOP)
    assert not any(o["events"][-1] == "[DONE]" for o in outs), "a stream ended before the freeze"
    frozen_at = time.monotonic()
    try:
        for t in threads:
            t.join(STALL_TIMEOUT_S + 15)
        ended_s = time.monotonic() - frozen_at
        assert not any(t.is_alive() for t in threads), "streams still waiting on a frozen worker"
        assert ended_s < STALL_TIMEOUT_S + 15, ended_s   # not stream_idle_timeout_s (120 s)
        for out in outs:
            assert out.get("status") == 200, out
            (err,) = _errors(out)
            assert "stopped advancing" in err["message"] or "stalled" in err["message"], err
        while True:   # the registry's own verdict, within stall_timeout_s and a poll or two
            health = httpx.get(deployment.url + "/health", timeout=5)
            problem = health.json()["workers"][deployment.decode_address].get("problem", "")
            if health.status_code == 503 and "stall" in problem:
                break
            assert time.monotonic() - frozen_at < STALL_TIMEOUT_S + 5, health.text
            time.sleep(0.2)
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 60
    while httpx.get(deployment.url + "/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, "the worker was not routed to again"
        time.sleep(0.5)
    r = httpx.post(deployment.url + "/v1/chat/completions", timeout=60, json={
        "model": _model(deployment), "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4})
    assert r.status_code == 200, r.text
