"""A worker's settings split by who uses them: the engine's frozen ``EngineConfig``, the KV
store's ``StoreSettings`` and the process's own (network, registry, auth, logging).

Built once at start-up from ``WorkerSettings`` (common/settings.py, torch-free so that
``--help`` and the launcher stay light); from here on each part is handed only to its user.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from common.settings import StoreSettings, WorkerSettings
from engine.config import EngineConfig, engine_config_from_settings


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
