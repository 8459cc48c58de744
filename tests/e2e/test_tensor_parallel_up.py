"""`bulkhead up` with both workers at --tensor-parallel-size 2 (each a worker process plus one
spawned rank, collectives over gloo): greedy output equals transformers on the split route (the
decode worker loads, across its two ranks, the KV the two-rank prefill worker exported) and on
the decode-only route; GetInfo reports the layout; a rank killed with SIGKILL takes its worker
down with a non-zero status and the router stops routing to it."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from engine.parallel.ranks import RANK_DIED_EXIT
from proto import bulkhead_pb2 as pb
from proto import bulkhead_pb2_grpc as pb_grpc
from tests.e2e.conftest import CHUNK, E2E, deploy
from tests.e2e.test_tiny_deployment import complete_ids, token_prompt
from tests.helpers.tiny_model import hf_greedy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tp2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2E]:
    yield from deploy(tmp_path_factory, "--tensor-parallel-size", "2")


def _ranks_of(pid: int) -> list[int]:
    """The spawned rank processes under a worker (not multiprocessing's resource tracker)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmd = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
            if b"spawn_main" in cmd:
                found.append(int(child))
    return found


def _worker(tp2: E2E, role: str):  # noqa: ANN202 - launch.launcher.ManagedProcess
    return next(p for p in tp2.deployment.group.processes if p.argv[3:4] == [role])


def test_split_route_matches_transformers(tp2: E2E) -> None:
    n = 5 * CHUNK + 7
    prompt = token_prompt(n, seed=5)
    loaded_before = tp2.metric("bulkhead_prompt_tokens_total", source="loaded")
    ids, usage = complete_ids(tp2, prompt, 12, stream=True)
    assert ids == hf_greedy(tp2.folder, prompt, 12)
    assert usage["prompt_tokens"] == n
    # whole blocks of KV went prefill (2 ranks) -> LMCache/Redis -> decode (2 ranks)
    assert tp2.metric("bulkhead_prompt_tokens_total", source="loaded") == \
        loaded_before + n // 16 * 16


def test_decode_route_matches_transformers(tp2: E2E) -> None:
    prompt = token_prompt(9, seed=6)
    ids, _ = complete_ids(tp2, prompt, 10, stream=False)
    assert ids == hf_greedy(tp2.folder, prompt, 10)


def test_workers_report_their_layout(tp2: E2E) -> None:
    for address in (tp2.deployment.prefill_address, tp2.deployment.decode_address):
        with grpc.insecure_channel(address) as ch:
            info = pb_grpc.WorkerStub(ch).GetInfo(pb.WorkerInfoRequest(), timeout=5)
        assert info.tensor_parallel_size == 2
    for role in ("prefill", "decode"):
        assert len(_ranks_of(_worker(tp2, role).pid)) == 1


def test_a_dead_rank_takes_its_worker_down(tp2: E2E) -> None:
    """Last in this module: it leaves the decode worker dead."""
    decode = _worker(tp2, "decode")
    (rank,) = _ranks_of(decode.pid)
    os.kill(rank, signal.SIGKILL)
    assert decode.popen.wait(timeout=30) == RANK_DIED_EXIT
    assert "exited (status -9) under a serving worker" in decode.log_tail()
    deadline = time.monotonic() + 30
    while tp2.routed_workers().get(tp2.deployment.decode_address, {}).get("healthy"):
        assert time.monotonic() < deadline, "the router still routes to the dead worker"
        time.sleep(0.2)
