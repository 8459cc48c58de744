"""A prefill and a decode worker as separate OS processes sharing one KV store, for handoff
tests; always torn down."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc

from common.worker_env import WORKER_ENV
from launch.health import grpc_serving
from launch.launcher import ProcessGroup, free_port, spawn, wait_until
from proto import bulkhead_pb2_grpc as pb_grpc
from tests.helpers.startup_budget import startup_budget_s


@contextlib.contextmanager
def worker_pair(model: Path, kv_store_url: str, flags: Sequence[str], log_dir: Path,
                startup_timeout_s: float | None = None
                ) -> Iterator[tuple[pb_grpc.WorkerStub, pb_grpc.WorkerStub, list[Path]]]:
    """(prefill stub, decode stub, log paths) of two `bulkhead prefill|decode` processes;
    each must serve within ``startup_timeout_s`` (default: the suite's start-up budget)."""
    timeout_s = startup_budget_s() if startup_timeout_s is None else startup_timeout_s
    with ProcessGroup() as group:
        addresses = {}
        for role in ("prefill", "decode"):
            port = free_port()
            addresses[role] = f"127.0.0.1:{port}"
            argv = [sys.executable, "-m", "launch.cli", role, "--model", str(model),
                    "--port", str(port), "--kv-store-url", kv_store_url, *flags]
            group.add(spawn(role, argv, env=WORKER_ENV, log_dir=log_dir))
        for proc in group.processes:
            addr = addresses[proc.name]
            wait_until(proc, lambda a=addr: grpc_serving(a), timeout_s,
                       f"serving on {addr}")
        channels = [grpc.insecure_channel(addresses[r]) for r in ("prefill", "decode")]
        try:
            yield (pb_grpc.WorkerStub(channels[0]), pb_grpc.WorkerStub(channels[1]),
                   [p.log_path for p in group.processes if p.log_path])
        finally:
            for ch in channels:
                ch.close()


def handoff_flags(lmcache_chunk: int) -> list[str]:
    """The flags every handoff test's workers share: LMCache chunks of `lmcache_chunk` tokens,
    a small staging pool and one thread (two workers on a shared CPU), and a short wait for KV
    to become visible so that a missing chunk fails fast."""
    return ["--lmcache-chunk-size", str(lmcache_chunk), "--kv-staging-gb", "0.05",
            "--num-threads", "1", "--kv-visible-timeout-s", "5"]
