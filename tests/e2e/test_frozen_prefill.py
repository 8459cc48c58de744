"""A prefill worker frozen with SIGSTOP (never resumed while the test runs), real processes and
a real redis-server: the streams sent to it get SSE keep-alive comments at once, and complete
through the decode worker within stall_timeout_s plus the retry, instead of waiting out
prefill_timeout_s with zero bytes sent."""

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
from tests.e2e.conftest import SPLIT_THRESHOLD
from tests.helpers.startup_budget import startup_budget_s
from tests.helpers.stoppable_deployment import stoppable_deployment

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STALL_TIMEOUT_S = 3.0
KEEPALIVE_S = 0.5
RETRY_BOUND_S = 20.0   # the decode worker prefilling the prompt itself, on 2 shared cores


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    router_args = ("--split-threshold-tokens", str(SPLIT_THRESHOLD), "--poll-interval-s", "0.5",
                   "--stall-timeout-s", str(STALL_TIMEOUT_S), "--sse-keepalive-s", str(KEEPALIVE_S),
                   "--prefill-timeout-s", "300")
    with stoppable_deployment(tmp_path_factory, router_args, startup_budget_s()) as d:
        yield d


class Stream(threading.Thread):
    def __init__(self, url: str, model: str, prompt: str) -> None:
        super().__init__(daemon=True)
        self.url, self.model, self.prompt = url, model, prompt
        self.sent_at = 0.0
        self.first_byte_s: float | None = None
        self.first_token_s: float | None = None
        self.done_s: float | None = None
        self.keepalives_before_token = 0
        self.data: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"model": self.model, "messages": [{"role": "user", "content": self.prompt}],
                "max_tokens": 8, "stream": True, "temperature": 0}
        self.sent_at = time.monotonic()
        try:
            with httpx.stream("POST", self.url + "/v1/chat/completions", json=body,
                              timeout=400) as resp:
                assert resp.status_code == 200, resp.read()
                for line in resp.iter_lines():
                    now = time.monotonic() - self.sent_at
                    if line and self.first_byte_s is None:
                        self.first_byte_s = now
                    if line.startswith(":") and self.first_token_s is None:
                        self.keepalives_before_token += 1
                    if line.startswith("data: "):
                        if self.first_token_s is None:
                            self.first_token_s = now
                        self.data.append(line[6:])
            self.done_s = time.monotonic() - self.sent_at
        except BaseException as exc:  # reported by the test
            self.error = exc


def test_requests_on_a_frozen_prefill_worker_complete_elsewhere(deployment: Deployment) -> None:
    url = deployment.url
    model = deployment.model_name
    prompt = "please summarise this long request " * 12   # over the split threshold
    warm = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 2})
    assert warm.status_code == 200, warm.text
    prefill = next(p for p in deployment.group.processes if p.argv[3:4] == ["prefill"])
    os.kill(prefill.pid, signal.SIGSTOP)
    try:
        streams = [Stream(url, model, f"{i} {prompt}") for i in range(4)]
        for s in streams:
            s.start()
        for s in streams:
            s.join(STALL_TIMEOUT_S + RETRY_BOUND_S + 30)
        report = [(s.first_byte_s and round(s.first_byte_s, 2),
                   s.first_token_s and round(s.first_token_s, 2),
                   s.done_s and round(s.done_s, 2), s.keepalives_before_token) for s in streams]
        print("first byte s, first token s, done s, keep-alives before the token:", report)
        for s in streams:
            assert s.error is None, s.error
            assert s.data and s.data[-1] == "[DONE]", s.data[-3:]
            events = [json.loads(x) for x in s.data[:-1]]
            assert not any("error" in e for e in events), events
            assert any(c.get("finish_reason") for e in events for c in e["choices"])
            # bytes flowed long before the stall was called
            assert s.first_byte_s is not None and s.first_byte_s < KEEPALIVE_S + 1.0
            assert s.keepalives_before_token >= 1
            assert s.done_s is not None and s.done_s < STALL_TIMEOUT_S + RETRY_BOUND_S
        router_log = next(p for p in deployment.group.processes if p.name == "router").log_tail(
            20000)
        assert "the worker stopped advancing" in router_log, router_log
        # the frozen worker is still frozen: the requests really went elsewhere
        with open(f"/proc/{prefill.pid}/stat") as f:
            assert f.read().split(")")[1].split()[0] == "T"
    finally:
        os.kill(prefill.pid, signal.SIGCONT)
