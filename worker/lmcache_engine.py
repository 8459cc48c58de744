"""Building the LMCache engine behind a KV store: its remote backend is the shared store, its
chunks are ``[2, 1, chunk, row]`` uint8 objects of whole blocks, and our ``BlockConnector``
(worker/lmcache_connector.py) moves them. Only worker/kv_store.py calls it; a failure to start
is a ``KVStoreError`` whose message never quotes the store's password.
"""

from __future__ import annotations

from typing import Any

import torch

from common.redact import redact_text, redact_url
from worker.kv_store_config import KVStoreConfig, KVStoreError


def build_lmcache_engine(cfg: KVStoreConfig, instance_id: str) -> Any:  # noqa: ANN401
    """An LMCacheEngine (its type lives in a heavy import) named ``instance_id``."""
    from lmcache.utils import mock_up_broadcast_fn, mock_up_broadcast_object_fn
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    from worker.lmcache_connector import BlockConnector

    lm_config = LMCacheEngineConfig.from_defaults(
        chunk_size=cfg.chunk_size,
        local_cpu=False,
        max_local_cpu_size=cfg.staging_gb,
        remote_url=cfg.url,
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
