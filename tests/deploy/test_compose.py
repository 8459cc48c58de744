"""deploy/: the compose file is valid Compose, sets every setting as an environment variable, and
its router service runs, with the same command and environment, as a local process."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import jsonschema
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from router.settings import RouterSettings, load_settings
from tests.router.router_fakes import SCRIPT, FakeWorker, LoopThread, start_worker

pytestmark = pytest.mark.timeout(120)   # a hang is a failure, never a stuck CI

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
COMPOSE_SPEC = REPO / "tests" / "data" / "compose-spec.json"  # vendored: tests/data/README.md
_VAR = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's ${VAR:-default} / ${VAR} substitution, enough for our file."""
    if isinstance(value, str):
        return _VAR.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), value)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def resolved(compose: dict[str, Any]) -> dict[str, Any]:
    return interpolate(compose, {})


def test_compose_matches_the_compose_spec(compose: dict[str, Any]) -> None:
    schema = json.loads(COMPOSE_SPEC.read_text())
    validator = jsonschema.Draft7Validator(schema)
    validator.validate(compose)
    broken = {**compose, "services": {**compose["services"], "router": {
        **compose["services"]["router"], "restart": ["always"]}}}
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(broken)


def test_services_gpus_health_restart_volume(resolved: dict[str, Any]) -> None:
    services = resolved["services"]
    assert set(services) == {"redis", "router", "prefill", "decode"}
    for name, svc in services.items():
        assert svc["restart"] == "unless-stopped", name
        assert svc["healthcheck"]["test"][0] == "CMD", name
    for name, gpu in (("prefill", "0"), ("decode", "1")):
        (dev,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert dev["device_ids"] == [gpu] and dev["capabilities"] == ["gpu"]
        assert services[name]["command"] == ["bulkhead", name]
        assert "models:/models:ro" in services[name]["volumes"]
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert "models" in resolved["volumes"]
    router = services["router"]
    assert router["command"] == ["bulkhead", "router"]
    assert {d: c["condition"] for d, c in router["depends_on"].items()} == {
        "prefill": "service_healthy", "decode": "service_healthy"}
    env = router["environment"]
    assert env["BULKHEAD_PREFILL_WORKERS"] == "prefill:50051"
    assert env["BULKHEAD_DECODE_WORKERS"] == "decode:50052"
    assert services["prefill"]["environment"]["BULKHEAD_PORT"] == "50051"
    assert services["decode"]["environment"]["BULKHEAD_PORT"] == "50052"
    assert env["BULKHEAD_HOST"] == "0.0.0.0"


def test_every_setting_is_an_environment_variable(resolved: dict[str, Any]) -> None:
    services = resolved["services"]
    router_env = services["router"]["environment"]
    missing = [f"BULKHEAD_{n.upper()}" for n in RouterSettings.__dataclass_fields__
               if f"BULKHEAD_{n.upper()}" not in router_env]
    assert not missing, f"router settings missing from docker-compose.yml: {missing}"
    settings = load_settings([], {k: str(v) for k, v in router_env.items()})
    assert settings.decode_workers == ("decode:50052",) and settings.port == 8000
    common_settings = pytest.importorskip("common.settings")
    for role in ("prefill", "decode"):
        env = {k: str(v) for k, v in services[role]["environment"].items()}
        missing = [f"BULKHEAD_{n.upper()}" for n in
                   common_settings.WorkerSettings.__dataclass_fields__
                   if n != "role" and f"BULKHEAD_{n.upper()}" not in env]
        assert not missing, f"{role} settings missing from docker-compose.yml: {missing}"
        ws = common_settings.load_worker_settings(role, [], env)
        assert ws.bind_port == int(env["BULKHEAD_PORT"]) and ws.address == f"{role}:{ws.bind_port}"
        assert ws.kv_store_url == "redis://redis:6379"


def test_dockerfile_copies_what_exists_and_selects_torch() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    for src in re.findall(r"^COPY (\S+)", text, flags=re.M):
        assert (REPO / src).exists(), f"Dockerfile copies {src}, which is not in the repository"
    assert "download.pytorch.org/whl/cpu" in text and "TORCH_VERSION=2.13.0" in text
    assert 'cuda) index="https://download.pytorch.org/whl/${TORCH_CUDA}"' in text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def loop() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


def test_grpc_health_script(loop: LoopThread) -> None:
    async def start() -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
        server = grpc.aio.server()
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, servicer, port

    server, servicer, port = loop.run(start())
    script = [sys.executable, str(DEPLOY / "healthcheck_grpc.py")]
    try:
        loop.run(servicer.set("", health_pb2.HealthCheckResponse.SERVING))
        assert subprocess.run([*script, f"127.0.0.1:{port}"], timeout=30).returncode == 0
        loop.run(servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING))
        assert subprocess.run([*script, f"127.0.0.1:{port}"], timeout=30).returncode == 1
    finally:
        loop.run(server.stop(grace=None))
    started = time.monotonic()
    assert subprocess.run([*script, f"127.0.0.1:{port}"], timeout=30).returncode == 1
    assert time.monotonic() - started < 10


def test_router_service_runs_as_a_local_process(resolved: dict[str, Any],
                                                loop: LoopThread) -> None:
    """The compose router command and environment, with hostnames pointed at local workers."""
    pytest.importorskip("common.tokenizer")
    default_model = pytest.importorskip("common.default_model")
    try:
        model = default_model.default_model_path()
    except default_model.DefaultModelMissing as exc:
        pytest.skip(str(exc))
    from common.tokenizer import Tokenizer

    tok = Tokenizer.from_path(model)
    script = tok.encode(SCRIPT, add_special_tokens=False)
    workers = {role: FakeWorker(role, script, tok.eos_token_ids[0], max_context=2048)
               for role in ("prefill", "decode")}
    servers = [loop.run(start_worker(w)) for w in workers.values()]
    svc = resolved["services"]["router"]
    port = _free_port()
    env = {k: str(v) for k, v in svc["environment"].items()}
    env["BULKHEAD_PREFILL_WORKERS"] = workers["prefill"].address
    env["BULKHEAD_DECODE_WORKERS"] = workers["decode"].address
    env["BULKHEAD_PORT"] = str(port)           # the container's port, free on this host
    env["BULKHEAD_HOST"] = "127.0.0.1"
    assert svc["command"][:2] == ["bulkhead", "router"]
    # `bulkhead router ARGS` dispatches to router.server.main(ARGS)
    cmd = [sys.executable, "-m", "router.server", *svc["command"][2:]]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "router did not become healthy"
            time.sleep(0.2)
        models = httpx.get(base + "/v1/models").json()
        assert models["data"][0]["id"] == model.stem
        r = httpx.post(base + "/v1/chat/completions", timeout=30, json={
            "model": model.stem, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == SCRIPT
        # the chat template of the real model rendered the prompt the decode worker received
        (gen,) = workers["decode"].generates
        text = tok.decode(list(gen.prompt_token_ids), skip_special_tokens=False)
        assert text == tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    finally:
        proc.terminate()
        try:
            out = proc.communicate(timeout=20)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            out = proc.communicate()[0]
        for s in servers:
            loop.run(s.stop(grace=None))
    # SIGTERM: graceful shutdown (uvicorn then re-raises the signal, as its default action)
    assert proc.returncode in (0, -15), out
    assert "Application shutdown complete" in out, out


def test_router_cli_errors_are_clear() -> None:
    r = subprocess.run([sys.executable, "-m", "router.server", "--port", "70000"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "port: 70000" in r.stderr
    r = subprocess.run([sys.executable, "-m", "router.server"], cwd=REPO, capture_output=True,
                       text=True, timeout=60, env={**os.environ, "BULKHEAD_DECODE_WORKERS": ""})
    assert r.returncode == 2 and "BULKHEAD_DECODE_WORKERS" in r.stderr



def test_readme_documents_every_setting() -> None:
    text = (DEPLOY / "README.md").read_text()
    for name in RouterSettings.__dataclass_fields__:
        assert f"`BULKHEAD_{name.upper()}`" in text, name
    common_settings = pytest.importorskip("common.settings")
    for name in common_settings.WorkerSettings.__dataclass_fields__:
        assert name == "role" or f"`BULKHEAD_{name.upper()}`" in text, name


def test_example_config_loads_for_every_component() -> None:
    path = str(DEPLOY / "bulkhead.example.yaml")
    router = load_settings(["--config", path], {})
    assert router.decode_workers == ("127.0.0.1:50052",) and router.host == "0.0.0.0"
    common_settings = pytest.importorskip("common.settings")
    prefill = common_settings.load_worker_settings("prefill", ["--config", path], {})
    decode = common_settings.load_worker_settings("decode", ["--config", path], {})
    assert prefill.address == router.prefill_workers[0] and decode.address == "127.0.0.1:50052"
    for name in ("dtype", "block_size", "lmcache_chunk_size", "max_context"):
        assert getattr(prefill, name) == getattr(decode, name), name
