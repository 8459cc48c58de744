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
from dataclasses import dataclass

from common.settings import StoreSettings, WorkerSettings
from engine.config import EngineConfig, engine_config_from_settings

MiB = 1 << 20
STAGING_GB_CUDA = 0.5  # kv_staging_gb = 0 on CUDA; on the CPU: one sequence's KV (staging_gb)


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
        return cls(settings, engine, settings.store)


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
