"""Two prefill and two decode worker processes on one Redis KV store, and a router given their
addresses (no registry): the cluster the e2e tests of failures kill or poison workers in."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from launch.health import grpc_serving, router_ready
from launch.launcher import (
    ManagedProcess,
    ProcessGroup,
    free_port,
    spawn,
    start_kv_server,
    wait_until,
)

NAMES = (("p1", "prefill"), ("p2", "prefill"), ("d1", "decode"), ("d2", "decode"))


def start_static_cluster(group: ProcessGroup, log_dir: Path, model: str, *,
                         worker_module: str, worker_flags: Sequence[str],
                         env: dict[str, str], router_flags: Sequence[str],
                         worker_timeout_s: float, router_timeout_s: float,
                         ) -> tuple[str, dict[str, ManagedProcess], dict[str, str]]:
    """Start the cluster in ``group``; -> (router URL, name -> process, name -> address) once
    every worker answers grpc.health.v1 and the router sees all four. ``worker_module``: what
    ``python -m`` runs with ``ROLE --model ...`` (``launch.cli``, or a test's worker)."""
    _, kv_url = start_kv_server(log_dir=log_dir)
    procs: dict[str, ManagedProcess] = {}
    addr: dict[str, str] = {}
    for name, role in NAMES:
        port = free_port()
        addr[name] = f"127.0.0.1:{port}"
        argv = [sys.executable, "-m", worker_module, role, "--model", model, "--port", str(port),
                "--kv-store-url", kv_url, *worker_flags]
        procs[name] = group.add(spawn(name, argv, env=env, log_dir=log_dir))
    for name, proc in procs.items():
        wait_until(proc, lambda a=addr[name]: grpc_serving(a), worker_timeout_s, "serving")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    workers = [a for name, role in NAMES for a in (f"--{role}", addr[name])]
    router = group.add(spawn("router", [sys.executable, "-m", "launch.cli", "router", "--model",
                                        model, "--port", str(port), *workers, *router_flags],
                             log_dir=log_dir))
    wait_until(router, lambda: router_ready(url, len(NAMES)), router_timeout_s, "all workers up")
    return url, procs, addr
