"""The compose services' commands and environment, run as local processes (no Docker on CI).

redis-server, `bulkhead prefill`, `bulkhead decode` and `bulkhead router` start with exactly the
environment docker-compose.yml gives them, except what a CPU-only host must change: service
hostnames become loopback addresses with free ports, the device is the CPU and the plan is
smaller.  The health checks are the compose ones.  Then the OpenAI API answers, and a long prompt
takes the split path with its KV loaded by the decode worker.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.deploy.test_compose import DEPLOY, REPO, interpolate
from tests.helpers.startup_budget import startup_budget_s

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CPU_OVERRIDES = {"BULKHEAD_DEVICE": "cpu", "BULKHEAD_MAX_CONTEXT": "2048",
                 "BULKHEAD_MAX_BATCH": "2", "BULKHEAD_KV_STAGING_GB": "0.25",
                 "BULKHEAD_NUM_THREADS": "1"}


def _rewrite(value: str, hosts: dict[str, str]) -> str:
    for old, new in hosts.items():
        value = value.replace(old, new)
    return value


def _health_ok(test: list[str], hosts: dict[str, str]) -> bool:
    assert test[0] == "CMD"
    argv = [sys.executable if a == "python" else _rewrite(a, hosts) for a in test[1:]]
    argv = [str(REPO / a.removeprefix("/app/")) if a.startswith("/app/") else a for a in argv]
    return subprocess.run(argv, cwd=REPO, capture_output=True, timeout=30).returncode == 0


def test_compose_services_run_as_local_processes(tmp_path: Path) -> None:
    launcher = pytest.importorskip("launch.launcher")
    pytest.importorskip("prefill_worker.server")
    pytest.importorskip("decode_worker.server")
    if launcher.redis_server_path() is None:
        pytest.skip("redis-server is not installed")
    compose: dict[str, Any] = interpolate(
        yaml.safe_load((DEPLOY / "docker-compose.yml").read_text()), {})
    services = compose["services"]
    group = launcher.ProcessGroup()
    try:
        _, redis_url = launcher.start_redis(log_dir=tmp_path)
        ports = {name: launcher.free_port() for name in ("prefill", "decode", "router")}
        hosts = {"redis://redis:6379": redis_url,
                 "prefill:50051": f"127.0.0.1:{ports['prefill']}",
                 "decode:50052": f"127.0.0.1:{ports['decode']}",
                 "127.0.0.1:50051": f"127.0.0.1:{ports['prefill']}",
                 "127.0.0.1:50052": f"127.0.0.1:{ports['decode']}",
                 "127.0.0.1:8000": f"127.0.0.1:{ports['router']}"}
        procs = {}
        for name in ("prefill", "decode", "router"):
            svc = services[name]
            env = {k: _rewrite(str(v), hosts) for k, v in svc["environment"].items()}
            env.update(BULKHEAD_HOST="127.0.0.1", BULKHEAD_PORT=str(ports[name]))
            if name != "router":
                env.update(CPU_OVERRIDES)
            assert svc["command"][0] == "bulkhead"
            argv = [sys.executable, "-m", "launch.cli", *svc["command"][1:]]
            procs[name] = group.add(launcher.spawn(name, argv, env=env, log_dir=tmp_path,
                                                   cwd=str(REPO)))
            if name != "router":
                continue
            for worker in ("prefill", "decode"):
                launcher.wait_until(procs[worker], lambda w=worker: _health_ok(
                    services[w]["healthcheck"]["test"], hosts), startup_budget_s(5 / 3), "healthy")
        base = f"http://127.0.0.1:{ports['router']}"
        launcher.wait_until(procs["router"], lambda: _health_ok(
            services["router"]["healthcheck"]["test"], hosts), 60, "healthy")
        # Both workers healthy in the router's own view (its GetInfo poll), not only in their
        # health checks: until then a long prompt would be (correctly) served without a split.
        from launch.health import router_ready
        launcher.wait_until(procs["router"], lambda: router_ready(base, 2), 60, "both workers up")
        assert len(httpx.get(base + "/health").json()["workers"]) == 2

        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0,
                               timeout=120)
        model = client.models.list().data[0].id
        r = client.chat.completions.create(
            model=model, temperature=0, max_tokens=16,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in r.choices[0].message.content
        long_prompt = "Paris is the capital and largest city of France. " * 40
        r = client.completions.create(model=model, prompt=long_prompt, max_tokens=8,
                                      temperature=0)
        assert r.usage.prompt_tokens >= 256 and r.usage.completion_tokens == 8
        metrics = httpx.get(base + "/metrics").text
        routes = [ln for ln in metrics.splitlines() if ln.startswith("bulkhead_routes_total")]
        assert 'bulkhead_routes_total{route="split"} 1.0' in routes, routes
        loaded = next(line for line in metrics.splitlines()
                      if line.startswith('bulkhead_prompt_tokens_total{source="loaded"}'))
        assert float(loaded.split()[-1]) > 0   # the decode worker loaded the prefilled KV
        assert all(p.alive() for p in procs.values())
    finally:
        group.stop_all()
