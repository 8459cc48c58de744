"""The engine configuration's model-dependent sizes fixed before anything is planned: an
operator may leave the block size, the attention tile and the longest context to the model
(0 in ``EngineConfig``), and a value the model forbids is refused here naming one that works.

* ``block_size``: the family's default (dense 16; a sparse family whose compressors close
  windows inside blocks, a multiple of their rates).
* ``attn_tile_tokens``: 256 keys rounded up to whole blocks.
* ``max_context`` (auto): on CUDA the longest context, in whole blocks, whose plan fits the
  memory budget with every running sequence able to reach it, up to the model's own limit; on
  the CPU min(``CPU_AUTO_CONTEXT``, the model's limit), since there "fits" would mean the host's
  RAM, which a laptop shares with everything else.

Runs once, at the entry point (``LLMEngine.from_config``, ``bulkhead plan``; before any
weight is read: ``memory_planner.resolve_config_before_load``); an engine built
directly resolves what it is handed. Never allocates device memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from engine.config import EngineConfig
from engine.errors import PlanError
from engine.model_config import ModelConfig
from engine.models.family import family_class

CPU_AUTO_CONTEXT = 4096
ATTN_TILE_TOKENS = 256

PlanFits = Callable[[EngineConfig], bool]


def resolve_engine_config(ec: EngineConfig, model: ModelConfig,
                          plan_fits: PlanFits | None = None) -> EngineConfig:
    """``ec`` with its 0 (= from the model) sizes fixed and checked against ``model``.
    ``plan_fits(candidate)`` says whether a candidate's plan fits the device (CUDA auto
    context); without it, auto resolves as on the CPU."""
    family = family_class(model)
    block = ec.block_size or family.default_block_size(model)
    problem = family.block_size_problem(model, block)
    if problem:
        raise PlanError(problem)
    tile = ec.attn_tile_tokens or -(-max(ATTN_TILE_TOKENS, block) // block) * block
    if tile % block:
        raise PlanError(f"attn_tile_tokens={tile} must be a multiple of block_size={block}; "
                        f"{-(-tile // block) * block} would do")
    # a set max_context past the model's own limit is the operator's call (rope scaling may
    # carry it); auto never goes past it
    limit = family.context_limit(model)
    out = dataclasses.replace(ec, block_size=block, attn_tile_tokens=tile,
                              max_context=ec.max_context or min(limit, CPU_AUTO_CONTEXT))
    if ec.max_context or plan_fits is None or ec.torch_device.type != "cuda":
        return out
    return dataclasses.replace(out, max_context=longest_fitting_context(out, limit, plan_fits))


def longest_fitting_context(ec: EngineConfig, limit: int, plan_fits: PlanFits) -> int:
    """The largest context in whole blocks (at most ``limit``) whose plan fits; the smallest
    candidate when none does, so that the plan's own error names the terms."""
    block = ec.block_size
    lo, hi = 1, max(1, limit // block)  # in blocks

    def fits(blocks: int) -> bool:
        try:
            return plan_fits(dataclasses.replace(ec, max_context=min(limit, blocks * block)))
        except PlanError:  # e.g. num_blocks too small for this context: does not fit
            return False

    if fits(hi):
        return limit
    if not fits(lo):
        return min(limit, block)
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return min(limit, lo * block)
