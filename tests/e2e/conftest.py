"""A whole deployment as separate OS processes, started by the code behind `bulkhead up`: a real
redis-server, a prefill worker, a decode worker (both `python -m launch.cli <role>`) and the
router, serving a tiny random Llama with a real tokenizer. Workers can be restarted in place (same
command line and port). Always torn down (process groups)."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from launch.health import grpc_serving
from launch.launcher import ManagedProcess, redis_server_path, spawn, wait_until
from launch.up import Deployment, start
from launch.up_options import UpOptions
from tests.helpers.startup_budget import startup_budget_s
from tests.helpers.tiny_model import write_tiny_llama

CHUNK = 16  # LMCache chunk: long prompts span several
SPLIT_THRESHOLD = 40  # uncached prompt tokens from which the router splits
MAX_CONTEXT = 384
# float32: the tests compare greedy tokens and logprobs with transformers' float32 model (the
# product's default is bfloat16)
WORKER_FLAGS = ("--device", "cpu", "--dtype", "float32", "--max-context", str(MAX_CONTEXT),
                "--chunk-tokens", "48",
                "--max-batch", "8", "--block-size", "16", "--attn-tile-tokens", "64",
                "--lmcache-chunk-size", str(CHUNK), "--kv-staging-gb", "0.05",
                "--num-threads", "1")


@dataclass
class E2E:
    deployment: Deployment
    folder: Path

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.deployment.url + "/v1", api_key="none",
                             max_retries=0, timeout=60.0)

    @property
    def model(self) -> str:
        return self.deployment.model_name

    def metric(self, name: str, **labels: str) -> float:
        """Sum of a Prometheus sample from the router's /metrics."""
        with urllib.request.urlopen(self.deployment.url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
        total = 0.0
        for line in text.splitlines():
            m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
            if not m:
                continue
            got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
            if all(got.get(k) == v for k, v in labels.items()):
                total += float(m.group(2))
        return total

    def routed_workers(self) -> dict[str, dict]:
        """The router's /health view: address -> {"role", "healthy"} (also read from a 503)."""
        try:
            with urllib.request.urlopen(self.deployment.url + "/health", timeout=2) as resp:
                body = resp.read()
        except urllib.error.HTTPError as exc:
            body = exc.read()
        except OSError:
            return {}
        return dict(json.loads(body).get("workers", {}))

    def restart_workers(self, *roles: str, timeout_s: float = 60.0) -> None:
        """Stop the worker processes of ``roles`` (SIGTERM, graceful exit), wait until the
        router has dropped them, start each again with the same command line and port, and wait
        until the router routes to them again."""
        group = self.deployment.group
        # a worker's argv is [python, -m, launch.cli, <role>, ...] (launch/up.py)
        old = {role: next(p for p in group.processes if p.argv[3:4] == [role]) for role in roles}
        address = {"prefill": self.deployment.prefill_address,
                   "decode": self.deployment.decode_address}
        for proc in old.values():
            assert proc.stop(grace_s=timeout_s) == 0, proc.log_tail()
        self._wait_router(lambda view: not any(view.get(address[r], {}).get("healthy")
                                               for r in roles), timeout_s, "dropped")
        started: list[ManagedProcess] = []
        for role, proc in old.items():
            # a log of its own: the stopped worker's log stays for the reader
            name = f"{role}-restart{len(list(self.deployment.log_dir.glob(role + '*.log')))}"
            new = spawn(name, proc.argv, env=proc.env, log_dir=self.deployment.log_dir)
            group.processes[group.processes.index(proc)] = new
            started.append(new)
        for proc, role in zip(started, roles, strict=True):
            wait_until(proc, lambda a=address[role]: grpc_serving(a), timeout_s, "serving")
        self._wait_router(lambda view: all(view.get(address[r], {}).get("healthy")
                                           for r in roles), timeout_s, "routing to")

    def _wait_router(self, ok: Callable[[dict[str, dict]], bool], timeout_s: float,
                     what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ok(view := self.routed_workers()):
            assert time.monotonic() < deadline, f"router not {what} the workers: {view}"
            time.sleep(0.2)


def deploy(tmp_path_factory: pytest.TempPathFactory, *extra_worker_args: str,
           write_model: Callable[[Path], Path] = write_tiny_llama,
           **up_options: object) -> Iterator[E2E]:
    """Start router + prefill + decode (+ redis) on a tiny Llama (or what ``write_model``
    writes); yields, then tears down. ``up_options``: more ``UpOptions`` fields (the flags
    of ``bulkhead up`` itself)."""
    if redis_server_path() is None:
        pytest.skip("redis-server is not installed")
    folder = write_model(tmp_path_factory.mktemp("tiny-llama"))
    log_dir = tmp_path_factory.mktemp("e2e-logs")
    from launch.launcher import free_port

    opts = UpOptions(model=str(folder), port=free_port(), log_dir=str(log_dir),
                     startup_timeout_s=startup_budget_s(),
                     extra_worker_args=(*WORKER_FLAGS, *extra_worker_args),
                     extra_router_args=("--split-threshold-tokens", str(SPLIT_THRESHOLD),
                                        "--poll-interval-s", "0.5"),
                     **up_options)  # type: ignore[arg-type]
    deployment = start(opts, log=lambda line: None)
    try:
        yield E2E(deployment, folder)
    finally:
        deployment.stop()


@pytest.fixture(scope="session")
def e2e(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2E]:
    """One deployment shared by every module that asks for ``e2e`` (echo logprobs, lm-eval
    parity, mixed load, sampling parameters, the tiny deployment, vLLM metrics): a start is
    20-60 s on 2 cores, and these tests only send requests, compare answers and read metric
    deltas, so they do not need a fresh one each. A module that stops, restarts or starves a
    process, or needs other flags, starts its own with ``deploy`` under the same name."""
    yield from deploy(tmp_path_factory)


def check_tool_calls(calls, schemas: dict[str, dict], names=None) -> None:  # noqa: ANN001
    """``calls`` (an OpenAI message's tool_calls) are there, each a function call of one of
    ``names`` (default: any of ``schemas``) whose arguments are valid under its schema."""
    import jsonschema

    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        assert c.function.name in (names or schemas)
        jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
