"""A worker's settings split by who uses them: the engine's frozen ``EngineConfig``, the KV
store's ``StoreSettings`` and the process's own (network, registry, auth, logging).

Built once at start-up from ``WorkerSettings`` (common/settings.py, torch-free so that
``--help`` and the launcher stay light); from here on each part is handed only to its user.
The KV staging's 0 ("by device") is fixed here (``staging_gb``), once the model's KV layout is
known; the engine's by-device settings (``kv_tokens``, the import slice) are fixed by
``engine_config_from_settings``. On the CPU they are sized for a laptop, where the plan is the
same RAM as everything else: ``bulkhead up`` with no arguments fits 2 GB there (docs/serving.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from common.settings import WorkerSettings
from engine.config import EngineConfig, engine_config_from_settings

MiB = 1 << 20
STAGING_GB_CUDA = 0.5  # kv_staging_gb = 0 on CUDA; on the CPU: one sequence's KV (staging_gb)


@dataclass(frozen=True)
class StoreSettings:
    """What a worker's KV store is built from; the shapes it stores come from the loaded model
    (worker/kv_store_config.py's KVStoreConfig adds them)."""

    url: str = field(repr=False)  # may hold the store's password
    chunk_size: int
    staging_gb: float
    ttl_s: int
    visible_timeout_s: float
    staging_pinned: bool = False
    fetch_connections: int = 4

    @classmethod
    def from_settings(cls, s: WorkerSettings) -> StoreSettings | None:
        """The KV store's settings; None when the worker has no store."""
        if not s.kv_store_url:
            return None
        return cls(s.kv_store_url, s.lmcache_chunk_size, s.kv_staging_gb, s.kv_ttl_s,
                   s.kv_visible_timeout_s, s.kv_staging_pinned, s.kv_fetch_connections)


@dataclass(frozen=True)
class WorkerConfig:
    settings: WorkerSettings  # with ``model`` resolved
    engine: EngineConfig
    store: StoreSettings | None  # None: no KV store (a decode worker then computes every prompt)

    @classmethod
    def from_settings(cls, settings: WorkerSettings) -> WorkerConfig:
        """Resolve the default model and build the engine's and the store's configs."""
        if not settings.model:
            from common.default_model import default_model_path

            settings = dataclasses.replace(settings, model=str(default_model_path()))
        engine = engine_config_from_settings(settings)
        return cls(settings, engine, StoreSettings.from_settings(settings))


def staging_gb(store: StoreSettings, engine: EngineConfig, bytes_per_token: float,
               chunk_tokens: int) -> float:
    """``kv_staging_gb``, its 0 resolved: 0.5 on CUDA; on the CPU one ``max_context`` sequence's
    KV (``engine`` resolved) in whole LMCache chunks of ``chunk_tokens``, and one chunk more."""
    if store.staging_gb:
        return store.staging_gb
    if engine.torch_device.type != "cpu":
        return STAGING_GB_CUDA
    tokens = (-(-engine.max_context // chunk_tokens) + 1) * chunk_tokens
    return -(-int(tokens * bytes_per_token) // MiB) / 1024
