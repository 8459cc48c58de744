"""A fetch over more connections than the default, from a redis-server started with io-threads
(the two knobs the handoff's fetch rate may depend on; launch/launcher.start_redis and the
worker setting kv_fetch_connections): the bytes arrive whole and exact either way."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
import torch

from launch.launcher import LaunchError, redis_server_path, start_redis
from tests.helpers.kv_layouts import llama_kv_layout


def test_io_threads_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="io_threads must be >= 1"):
        start_redis(log_dir=tmp_path, io_threads=0)


@pytest.mark.skipif(redis_server_path() is None, reason="redis-server is not installed")
@pytest.mark.parametrize("io_threads,connections", [(1, 1), (2, 7)])
def test_a_fetch_over_n_connections_from_a_threaded_redis_is_exact(
        tmp_path: Path, io_threads: int, connections: int) -> None:
    from worker.kv_store import KVStore

    proc, url = start_redis(log_dir=tmp_path, maxmemory_mb=64, io_threads=io_threads)
    try:
        assert redis.Redis.from_url(url).config_get("io-threads")["io-threads"] == str(io_threads)
        layout = llama_kv_layout(tmp_path)
        tokens = [7 + (i * 31) % 900 for i in range(23 * layout.block_size + 5)]  # 23 blocks + 5
        blocks = list(range(1, 24))
        kv = layout.allocate(24, torch.device("cpu"))
        kv.data.view(torch.uint8).random_(generator=torch.Generator().manual_seed(io_threads))
        store = KVStore(url, f"conn-{connections}", layout, chunk_size=2 * layout.block_size,
                        staging_gb=0.01, ttl_s=60, fetch_connections=connections)
        try:
            store.put(tokens, kv, blocks)
            assert store.wait_visible(tokens, timeout_s=30) == 23 * layout.block_size
            got, staged = store.fetch(tokens)
        finally:
            store.close()
        assert store._reader is not None and store._reader.num_connections == connections
        # 11 whole chunks of two blocks; the 23rd block is a chunk of its own
        assert got == 23 * layout.block_size and staged is not None
        assert torch.equal(staged.blocks, layout.export_blocks(kv, blocks))
    finally:
        proc.stop(grace_s=5.0)
