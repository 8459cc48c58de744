"""A tiny-llama deployment whose workers a test may freeze with SIGSTOP: started with the
router flags the test asks for, and every process continued (SIGCONT) before the stop, so a
worker left frozen still hears its SIGTERM and nothing is left behind."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from launch.launcher import free_port, redis_server_path
from launch.up import Deployment, start
from launch.up_options import UpOptions
from tests.e2e.conftest import WORKER_FLAGS
from tests.helpers.tiny_model import write_tiny_llama


@contextmanager
def stoppable_deployment(tmp_path_factory: pytest.TempPathFactory, router_args: tuple[str, ...],
                         startup_timeout_s: float) -> Iterator[Deployment]:
    """Skips the test where there is no redis-server."""
    if redis_server_path() is None:
        pytest.skip("redis-server is not installed")
    folder = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    opts = UpOptions(model=str(folder), port=free_port(),
                     log_dir=str(tmp_path_factory.mktemp("logs")),
                     startup_timeout_s=startup_timeout_s, extra_worker_args=WORKER_FLAGS,
                     extra_router_args=router_args)
    d = start(opts, log=lambda line: None)
    try:
        yield d
    finally:
        for p in d.group.processes:
            if p.alive():
                os.kill(p.pid, signal.SIGCONT)
        d.stop()
