"""Model families behind one contract (``engine.models.family.ModelFamily``).

``engine.models.family.family_class`` maps a ModelConfig to its implementation through
``registry.IMPLEMENTATIONS``; the engine, planner, loader and workers use only the contract and
never test a family's name. This package file imports nothing: ``engine.model_config`` reads
the registry at import time, and the contract imports ``engine.model_config``.
"""
