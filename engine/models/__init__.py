"""Model families behind one contract (``engine.models.family.ModelFamily``).

``family_class`` maps a ModelConfig to its implementation through ``registry.IMPLEMENTATIONS``;
the engine, planner, loader and workers use only the contract and never test a family's name.
Kept free of heavy imports: ``engine.model_config`` reads the registry at import time.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from engine.models.registry import IMPLEMENTATIONS

if TYPE_CHECKING:
    from engine.model_config import ModelConfig
    from engine.models.family import ModelFamily


def family_class(cfg: ModelConfig) -> type[ModelFamily]:
    """The ModelFamily subclass that serves ``cfg.family``."""
    from engine.errors import CheckpointError

    target = IMPLEMENTATIONS.get(cfg.family)
    if target is None:
        raise CheckpointError(f"model family {cfg.family!r} is not served yet")
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)
