"""Issue 39, item 4, against real worker processes (tiny Llama, real redis-server, the router,
the official openai client): a request whose step raises is failed alone, in a prefill and in a
decode worker, while plain streams beside it finish and no worker dies; a request that kills its
worker process is answered with the quarantine error, is not replayed on another worker (every
worker here would die of it too), and is refused at once when it comes again.

The fault is test-only: the workers run as `python -m tests.helpers.poison_worker`, which makes
a step holding token RAISE raise and one holding token DIE SIGKILL its own process."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from common.worker_env import WORKER_ENV
from launch.launcher import ManagedProcess, ProcessGroup, redis_server_path
from tests.e2e.conftest import SPLIT_THRESHOLD, WORKER_FLAGS
from tests.helpers.beside_streams import beside_plain_streams as beside
from tests.helpers.startup_budget import startup_budget_s
from tests.helpers.static_cluster import start_static_cluster
from tests.helpers.tiny_model import write_tiny_llama

RAISE, DIE = 300, 301   # token ids of the tiny model's 320 that no plain prompt here holds
SHORT = [(7 * i) % 200 + 20 for i in range(12)]                    # decode route
LONG = [(11 * i) % 200 + 20 for i in range(SPLIT_THRESHOLD + 30)]  # split route
ROUTES = {"decode": SHORT, "split": LONG}
# the killing requests' prompts: none of them cached by an earlier test (a cached prefix would
# leave too few new tokens to split)
FRESH = {"decode": [(5 * i) % 200 + 20 for i in range(12)],
         "split": [(13 * i) % 200 + 20 for i in range(SPLIT_THRESHOLD + 30)]}


class Cluster:
    def __init__(self, url: str, procs: dict[str, ManagedProcess]) -> None:
        self.url = url
        self.procs = procs

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0,
                             timeout=60.0)

    def complete(self, prompt: list[int], **kw):
        return self.client().completions.create(model="tiny", prompt=prompt, **kw)

    def dead(self) -> set[str]:
        return {name for name, p in self.procs.items() if not p.alive()}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if redis_server_path() is None:
        pytest.skip("redis-server is not installed")
    folder = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    log_dir: Path = tmp_path_factory.mktemp("poison-logs")
    env = {**WORKER_ENV, "POISON_RAISE_TOKEN": str(RAISE), "POISON_DIE_TOKEN": str(DIE)}
    with ProcessGroup() as group:
        url, procs, _ = start_static_cluster(
            group, log_dir, str(folder), worker_module="tests.helpers.poison_worker",
            worker_flags=WORKER_FLAGS, env=env,
            router_flags=("--served-model-name", "tiny", "--split-threshold-tokens",
                          str(SPLIT_THRESHOLD), "--poll-interval-s", "0.5"),
            worker_timeout_s=startup_budget_s(), router_timeout_s=startup_budget_s())
        yield Cluster(url, procs)


def beside_plain_streams(c: Cluster, bad, num_streams: int = 3):
    """Run ``bad`` while plain streams run; -> what it returned or raised. The plain streams
    must all finish."""
    return beside(bad, lambda i: c.complete([30 + i, 40, 50, 60], max_tokens=48,
                                            temperature=0.0, stream=True,
                                            extra_body={"ignore_eos": True}), num_streams)


@pytest.mark.parametrize("route", ["decode", "split"])
def test_a_step_that_raises_fails_that_request_alone(cluster: Cluster, route: str) -> None:
    got = beside_plain_streams(
        cluster, lambda: cluster.complete(ROUTES[route] + [RAISE], max_tokens=8))
    assert isinstance(got, openai.APIStatusError), got
    message = got.body["message"]
    assert got.status_code == 502 and got.body["code"] == "worker_error", got.body
    assert "step running this request raised RuntimeError: test poison" in message
    assert "ended alone" in message
    phase = "prefill" if route == "split" else "first_token"  # which worker's step raised
    assert f"({phase} on worker" in message
    assert cluster.dead() == set()
    # the worker serves on, the same prompt without the poison included
    assert cluster.complete(ROUTES[route], max_tokens=4).choices[0].text is not None


@pytest.mark.parametrize("route", ["decode", "split"])
def test_a_request_that_kills_its_worker_is_quarantined_not_replayed(cluster: Cluster,
                                                                     route: str) -> None:
    role = "p" if route == "split" else "d"
    dead_before = cluster.dead()
    bad = FRESH[route] + [DIE]
    with pytest.raises(openai.InternalServerError) as e:
        cluster.complete(bad, max_tokens=8)
    body = e.value.body
    assert body["code"] == "request_quarantined", body
    assert "died while running it, the only request running there" in body["message"]
    # one worker died of it, and only one: it was not handed to another (which would die too)
    deadline = time.monotonic() + 10.0  # its sockets close a moment before it can be reaped
    while not cluster.dead() - dead_before and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)
    killed = cluster.dead() - dead_before
    assert len(killed) == 1 and next(iter(killed)).startswith(role), killed
    # again: refused at once, and no other worker dies
    started = time.monotonic()
    with pytest.raises(openai.InternalServerError) as e:
        cluster.complete(bad, max_tokens=8)
    assert e.value.body["code"] == "request_quarantined"
    assert time.monotonic() - started < 2.0
    assert cluster.dead() == dead_before | killed
    # the survivors serve on (the prompt without its poison token)
    assert cluster.complete(FRESH[route], max_tokens=4).choices[0].text is not None
