"""Access control of a real worker over real gRPC (worker/auth.py + router/worker_client.py):
with internal_token set, every Worker call without the token, or with a wrong one, gets
UNAUTHENTICATED with the reason and never runs; the router's client with the token and the CA
gets through over TLS; grpc.health.v1 stays open; no token reaches a log."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.settings import SettingsError, WorkerSettings
from decode_worker.server import DecodeServicer
from proto import bulkhead_pb2 as pb
from router.errors import WorkerCallError
from router.worker_client import CallDeadlines, WorkerAccess, WorkerClient
from router.worker_codec import Sampling, WorkItem
from tests.helpers.loop_thread import LoopThread
from tests.helpers.tiny_model import write_tiny_llama
from tests.helpers.tls import TlsFiles, write_tls_files
from worker.auth import AccessError, server_credentials, token_problem, warn_if_open
from worker.worker_base import RunningServer, WorkerRuntime, build_runtime, start_server

TOKEN = "tok-Hq93-internal"
DEADLINES = CallDeadlines(5.0, 30.0, 30.0, 30.0)


@dataclass
class SecuredWorker:
    address: str
    tls: TlsFiles
    lt: LoopThread

    def client(self, token: str = TOKEN, tls: bool = True) -> WorkerClient:
        ca = str(self.tls.ca_file) if tls else ""
        return WorkerClient(self.address, DEADLINES, WorkerAccess.load(token, ca))


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredWorker]:
    folder = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    tls = write_tls_files(tmp_path_factory.mktemp("tls"))
    settings = WorkerSettings(role="decode", model=str(folder), device="cpu", dtype="float32",
                              max_context=128, chunk_tokens=32, max_batch=2, block_size=16,
                              attn_tile_tokens=64, num_threads=1, internal_token=TOKEN,
                              tls_cert_file=str(tls.cert_file), tls_key_file=str(tls.key_file))
    rt: WorkerRuntime = build_runtime(settings)
    lt = LoopThread()
    running: RunningServer = lt.run(start_server(rt, DecodeServicer, "127.0.0.1", 0))
    try:
        yield SecuredWorker(f"127.0.0.1:{running.port}", tls, lt)
    finally:
        lt.run(running.stop(1.0))
        rt.close()
        lt.close()


async def _generate(client: WorkerClient) -> list[int]:
    item = WorkItem("", (5, 6, 7, 8), Sampling(max_tokens=3, temperature=0.0))
    return [t async for chunk in client.generate(item) for t in chunk.token_ids]


async def _refusal(worker: SecuredWorker, token: str, call: str,
                   tls: bool = True) -> WorkerCallError:
    client = worker.client(token, tls)  # a grpc.aio channel belongs to the loop it is made on
    with pytest.raises(WorkerCallError) as info:
        if call == "generate":
            await _generate(client)
        else:
            await client.get_info()
    await client.close()
    return info.value


def test_token_and_tls_let_the_router_in(worker: SecuredWorker) -> None:
    async def scenario() -> tuple[pb.WorkerInfo, list[int]]:
        client = worker.client()
        try:
            return await client.get_info(), await _generate(client)
        finally:
            await client.close()

    info, tokens = worker.lt.run(scenario())
    assert info.role == "decode" and info.max_context == 128
    assert len(tokens) == 3


@pytest.mark.parametrize("call", ["info", "generate"])
@pytest.mark.parametrize("token, reason", [("", "missing internal token"),
                                           ("not-the-token", "wrong internal token")])
def test_calls_without_the_right_token_are_refused(worker: SecuredWorker, call: str, token: str,
                                                   reason: str,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
        err = worker.lt.run(_refusal(worker, token, call))
    assert err.code == grpc.StatusCode.UNAUTHENTICATED
    assert reason in err.details and "internal_token" in err.details
    assert TOKEN not in err.details and (not token or token not in err.details)
    assert TOKEN not in caplog.text and (not token or token not in caplog.text)


def test_health_is_open_and_plaintext_is_refused(worker: SecuredWorker) -> None:
    creds = grpc.ssl_channel_credentials(root_certificates=worker.tls.ca_file.read_bytes())
    with grpc.secure_channel(worker.address, creds) as channel:
        got = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                        timeout=5)
    assert got.status == health_pb2.HealthCheckResponse.SERVING
    # the right token over a plaintext channel does not reach a TLS port
    err = worker.lt.run(_refusal(worker, TOKEN, "info", tls=False))
    assert err.code == grpc.StatusCode.UNAVAILABLE


def test_token_problem_reasons() -> None:
    assert token_problem([("authorization", f"Bearer {TOKEN}")], TOKEN) == ""
    assert token_problem([("authorization", f"bearer {TOKEN}")], TOKEN) == ""
    assert token_problem([], TOKEN).startswith("missing")
    assert token_problem([("authorization", TOKEN)], TOKEN).startswith("malformed")
    assert token_problem([("authorization", "Bearer x")], TOKEN).startswith("wrong")


@pytest.mark.parametrize("host, token, warned", [
    ("0.0.0.0", "", True), ("10.1.2.3", "", True), ("worker-0", "", True), ("::", "", True),
    ("127.0.0.1", "", False), ("localhost", "", False), ("::1", "", False),
    ("0.0.0.0", TOKEN, False),
])
def test_open_worker_warning(host: str, token: str, warned: bool,
                             caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="worker.auth"):
        warn_if_open(host, token, tls=True)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert bool(warnings) == warned
    assert not warned or "BULKHEAD_INTERNAL_TOKEN" in warnings[0].getMessage()


def test_tls_files_are_checked(tmp_path: Path) -> None:
    assert server_credentials("", "") is None
    with pytest.raises(AccessError, match="tls_cert_file: cannot read .*nope.pem"):
        server_credentials(str(tmp_path / "nope.pem"), __file__)
    with pytest.raises(SettingsError, match="give both"):
        WorkerSettings(tls_cert_file="/x.pem")


def test_container_health_probe_speaks_tls(worker: SecuredWorker) -> None:
    """deploy/healthcheck_grpc.py (compose's worker health check) reaches a TLS worker when
    given the CA, and fails without it."""
    import os
    import subprocess
    import sys

    probe = [sys.executable, str(Path(__file__).parents[2] / "deploy" / "healthcheck_grpc.py"),
             worker.address]
    env = {k: v for k, v in os.environ.items() if not k.startswith("BULKHEAD_")}
    plain = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=30)
    assert plain.returncode == 1
    secure = subprocess.run(probe, env={**env, "BULKHEAD_WORKER_TLS_CA_FILE":
                                        str(worker.tls.ca_file)},
                            capture_output=True, text=True, timeout=30)
    assert secure.returncode == 0, secure.stderr
