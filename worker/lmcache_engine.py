"""Building the LMCache engine behind a KV store: its remote backend is the shared store, its
chunks are ``[2, 1, chunk, row]`` uint8 objects of whole blocks, and our ``BlockConnector``
(worker/lmcache_connector.py) moves them. Only worker/kv_store.py calls it; a failure to start
is a ``KVStoreError`` whose message never quotes the store's password.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import torch

from common.redact import redact_text, redact_url
from worker.kv_store_config import REDIS_SCHEMES, KVStoreConfig, KVStoreError

# LMCache writes a prompt's chunks to Redis as one gather of up to 150 concurrent SETs (32 MiB
# each for Llama-3-8B at 256 tokens), so every write waits for most of the prompt's bytes: a
# 131,072-token prompt (16 GiB) took longer than redis-py 8's default 5 s socket timeout on the
# H200 (2026-12-03) and its whole put was dropped. The timeout covers the whole batch instead.
PUT_SOCKET_TIMEOUT_S = 300.0
CONNECT_TIMEOUT_S = 5.0


def lmcache_remote_url(url: str) -> str:
    """``url`` with socket timeouts for LMCache's Redis writes, unless the URL sets its own."""
    parts = urlsplit(url)
    if parts.scheme not in REDIS_SCHEMES:
        return url
    query = parse_qsl(parts.query, keep_blank_values=True)
    have = {k for k, _ in query}
    for key, value in (("socket_timeout", PUT_SOCKET_TIMEOUT_S),
                       ("socket_connect_timeout", CONNECT_TIMEOUT_S)):
        if key not in have:
            query.append((key, str(value)))
    return urlunsplit(parts._replace(query=urlencode(query)))


def lmcache_pool_gb(cfg: KVStoreConfig, writes: bool) -> float:
    """LMCache's CPU pool (allocated and zero-filled at start): a prompt's KV waits there until
    its write to the store is done, so a writer needs ``staging_gb``. A process that only reads
    a Redis store never enters it (worker/staged_fetch.py reads into its own arena), so it gets
    two chunks, not a second copy of the staging (17 GiB of host memory for a 128k Llama-3-8B
    prompt, which on the H200 run took the decode worker's host memory with it)."""
    if writes or urlsplit(cfg.url).scheme not in REDIS_SCHEMES:
        return cfg.staging_gb
    chunk_bytes = 2 * cfg.chunk_size * cfg.token_row_bytes  # LMCache object [2, 1, chunk, row]
    return min(cfg.staging_gb, 2 * chunk_bytes / 2**30)


def build_lmcache_engine(cfg: KVStoreConfig, instance_id: str,
                         writes: bool = True) -> Any:  # noqa: ANN401
    """An LMCacheEngine (its type lives in a heavy import) named ``instance_id``; ``writes``:
    whether this process puts KV (else its pool is small, see ``lmcache_pool_gb``)."""
    from lmcache.utils import mock_up_broadcast_fn, mock_up_broadcast_object_fn
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    from worker.lmcache_connector import BlockConnector

    lm_config = LMCacheEngineConfig.from_defaults(
        chunk_size=cfg.chunk_size,
        local_cpu=False,
        max_local_cpu_size=lmcache_pool_gb(cfg, writes),
        remote_url=lmcache_remote_url(cfg.url),
        remote_serde="naive",
        save_unfull_chunk=True,
        blocking_timeout_secs=cfg.blocking_timeout_s,
        lmcache_instance_id=instance_id,
    )
    metadata = LMCacheMetadata(
        model_name=cfg.model_name,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.uint8,
        kv_shape=(1, 2, cfg.chunk_size, 1, cfg.token_row_bytes),
        use_mla=False,
        chunk_size=cfg.chunk_size,
    )
    connector = BlockConnector(cfg.block_size, cfg.bytes_per_block, cfg.padded_block_bytes)
    try:
        engine = LMCacheEngineBuilder.get_or_create(
            instance_id, lm_config, metadata, connector,
            mock_up_broadcast_fn, mock_up_broadcast_object_fn,
        )
        engine.post_init()
    except Exception as e:  # LMCache raises assorted types for a bad backend
        LMCacheEngineBuilder.destroy(instance_id)
        raise KVStoreError(
            f"could not start LMCache with remote {redact_url(cfg.url)!r}: "
            f"{redact_text(str(e))}"
        ) from None  # the chained exception may quote the URL
    return engine
