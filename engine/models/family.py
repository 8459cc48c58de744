"""The contract between the generic engine and a model family.

Two implementations exist: the dense decoders (``dense_family.DenseFamily``: Llama, Qwen2, Qwen3)
and DeepSeek-V4 (``deepseek_v4.family.DeepseekV4Family``). The engine, the planner, the loader
and the workers talk to a family only through these two classes, so adding a family never adds
an ``if family == ...`` anywhere else. Nothing here allocates; implementations allocate their
KV only in ``KVLayout.allocate`` (once, at start-up) and their weights at construction.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import torch

from engine.config import EngineConfig
from engine.errors import CheckpointError, PlanError
from engine.kv_layout import CacheKind, KVLayout
from engine.memory_plan import PlanTerm
from engine.model_config import ModelConfig
from engine.models.registry import IMPLEMENTATIONS
from engine.scheduler import ScheduledChunk
from engine.step_batch import StepBatch
from engine.workspace import Workspace

# KVLayout and CacheKind are part of this contract (``ModelFamily.kv_layout``); they live in the
# leaf engine.kv_layout so that the planner and the KV store need not import the families.
__all__ = ["CacheKind", "KVLayout", "ModelFamily", "family_class"]


class ModelFamily(ABC):
    """One family of models as the engine runs it.

    Contract:
    - Class level (no weights needed, so ``bulkhead plan`` can use it): ``kv_layout`` gives the
      block geometry for an engine config and ``plan_terms`` every device-memory term of the
      family except the KV extent and the measured ones (weights, activations, workspace
      slices; ``in_workspace`` terms are carved from the workspace arena).
    - Instance (built from the loaded weights): ``forward(batch, kv, ws)`` runs one step of
      any mix of prefill chunks and decodes and returns hidden [N, hidden]; it writes state
      only into the blocks of ``batch.block_tables`` at the step's positions and never allocates
      beyond the plan. ``compute_logits`` writes [n, vocab] fp32 into a given buffer.
    - ``warmup_steps`` lists the worst-case steps the plan must survive; the runner runs them
      (KV writes to the null block), then calls ``reset``. ``prepare_warmup`` makes per-
      sequence bookkeeping claim the steps' positions (its contents are garbage).
    - ``uses_cuda_graphs``: whether a decode step is pure device work that graphs can replay.
    """

    uses_cuda_graphs: ClassVar[bool] = False
    #: why this family cannot verify draft tokens (engine/spec_decode.py), or None when it can:
    #: a verify step writes the KV of drafts that may be rejected, so every per-sequence state
    #: the step advances must roll back to the accepted length
    speculation_problem: ClassVar[str | None] = "it has no rollback of rejected draft tokens"
    #: False: a rejected draft's positions are simply written again later (KV addressed by
    #: position). True: the family puts its per-sequence state back to the verify chunk's start
    #: when the sequence's next chunk starts there again; the scheduler then counts none of a
    #: rejecting verify step's positions as computed (``SchedulerConfig.restart_rejected_verify``)
    restarts_rejected_verify: ClassVar[bool] = False
    #: the ``speculative_method`` values this family drafts with (besides none); ``mtp`` needs
    #: the model's own draft layers and ``propose_drafts``
    speculative_methods: ClassVar[tuple[str, ...]] = ("ngram",)
    #: pad rows of a graph step copy row 0 instead of writing to the null block (per-slot state)
    graph_pads_copy_first: ClassVar[bool] = False
    #: whether the family runs split over ranks (engine/parallel/): its constructor then takes
    #: ``tp`` (a ``RankGroup``) and the loader reads each rank's slices
    supports_tensor_parallel: ClassVar[bool] = False
    #: how the ranks hold the KV: "heads" (each its own KV heads; blocks are gathered on export)
    #: or "replicated" (each the whole KV, written identically; rank 0's blocks are exported)
    tensor_parallel_kv: ClassVar[str] = "heads"
    #: whether a step that raised may run again chunk by chunk to find the sequence that raises
    #: (engine/step_isolation.py): true where ``forward`` writes state only at the step's
    #: positions, so a re-run overwrites what the failed step left
    rerun_safe: ClassVar[bool] = True

    @classmethod
    @abstractmethod
    def kv_layout(cls, cfg: ModelConfig, ec: EngineConfig) -> KVLayout: ...

    @classmethod
    @abstractmethod
    def plan_terms(cls, cfg: ModelConfig, ec: EngineConfig,
                   weight_bytes: int | None) -> list[PlanTerm]: ...

    @classmethod
    def default_block_size(cls, cfg: ModelConfig) -> int:
        """The KV block size when the operator sets none."""
        return 16

    @classmethod
    def block_size_problem(cls, cfg: ModelConfig, block_size: int) -> str | None:
        """Why this model cannot use ``block_size`` (naming a value that would do), or None."""
        return None

    @classmethod
    def context_limit(cls, cfg: ModelConfig) -> int:
        """The longest sequence the model was made for (``max_position_embeddings``)."""
        return cfg.max_position_embeddings

    @classmethod
    def dummy_tensors(cls, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                      seed: int) -> Iterator[tuple[str, torch.Tensor]]:
        """``load_format=dummy``: every tensor the family loads, with the names, shapes and
        storage formats the loader would hand over for this config's checkpoint, filled with
        random values of the usual init spread on ``device`` (the same for the same seed), a few
        at a time (``device="meta"``: names, shapes and dtypes only). A quantization the config
        names that the family cannot hold is a CheckpointError."""
        raise CheckpointError(f"load_format=dummy: family {cfg.family} has no dummy weights")

    @classmethod
    def rank_model_config(cls, cfg: ModelConfig, size: int) -> ModelConfig:
        """The model as one of ``size`` tensor-parallel ranks holds it (what the planner plans
        per rank); raises PlanError naming the field that does not split by ``size``."""
        raise PlanError(f"tensor_parallel_size={size}: family {cfg.family} has no split over "
                        "ranks")

    @classmethod
    def tensor_slicer(cls, cfg: ModelConfig, rank: int, size: int,
                      shapes: Mapping[str, tuple[int, ...]]) -> Any:
        """``name -> TensorSlice | None`` (engine/parallel/shard_plan.py): what the loader
        reads of each tensor for ``rank`` (``shapes``: every tensor's shape in the checkpoint);
        None = every tensor whole (the family slices at construction)."""
        return None

    @classmethod
    def checkpoint_tensors(cls, cfg: ModelConfig,
                           present: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]] | None:
        """The tensors to load with their shapes (checked by the loader), or None to load every
        tensor present and let the family check them at construction."""
        return None

    #: whether the loader may cast every tensor to the engine dtype (False: quantized payloads
    #: and their scales are kept as stored and the family dequantizes them)
    cast_weights_on_load: ClassVar[bool] = True

    @staticmethod
    def keeps_stored_dtype(name: str) -> bool:
        """With ``cast_weights_on_load`` False: tensors kept in their stored dtype even when
        floating point (quantization scales), the rest of the floating tensors cast."""
        return False

    @classmethod
    def resident_weight_bytes(cls, weights: dict[str, torch.Tensor], ec: EngineConfig) -> int:
        """Device bytes of ``weights`` once the family holds them (the plan's weights term)."""
        return sum(t.numel() * t.element_size() for t in weights.values())

    @abstractmethod
    def forward(self, batch: StepBatch, kv: Any, ws: Workspace) -> torch.Tensor: ...

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor: ...

    @classmethod
    def step_context_limit(cls, ec: EngineConfig) -> int | None:
        """The scheduler's ``max_step_context``: the context the multi-token chunks of one step
        may reach together, where the plan counts a gather of it (None: no limit)."""
        return None

    def warmup_steps(self, ec: EngineConfig, table: tuple[int, ...]) -> list[list[ScheduledChunk]]:
        """The plan's worst steps: the longest chunk against the longest context, a full batch
        of decodes at the longest context, and a full token budget spread over a full batch."""
        chunk = min(ec.chunk_tokens, ec.max_context - 1)
        total = min(ec.chunk_tokens, ec.max_batch * (ec.max_context - 1))
        share = [total // ec.max_batch + (i < total % ec.max_batch) for i in range(ec.max_batch)]
        end = ec.max_context - 1
        return [
            [ScheduledChunk("warmup-prefill", end - chunk, chunk, (0,) * chunk, table, 0, True)],
            [ScheduledChunk(f"warmup-decode-{i}", end, 1, (0,), table, i, True)
             for i in range(ec.max_batch)],
            [ScheduledChunk(f"warmup-mixed-{i}", end - n, n, (0,) * n, table, i, True)
             for i, n in enumerate(share) if n > 0],
        ]

    def propose_drafts(self, kv: Any,
                       requests: list[tuple[int, int, int, int, list[int]]]) -> list[list[int]]:
        """The family's own drafts (``speculative_method=mtp``) for running decodes, each
        (cache slot, last token, its position, drafts wanted, block table)."""
        raise AssertionError(f"{type(self).__name__} has no draft model")

    def prepare_warmup(self, kv: Any, chunks: list[ScheduledChunk]) -> None:  # noqa: B027
        """Before a warm-up step: make per-sequence bookkeeping accept these chunks."""

    def before_graph_step(self, kv: Any, chunks: list[ScheduledChunk]) -> None:  # noqa: B027
        """Before a decode step replayed as a CUDA graph (which runs no host code of the
        family's ``forward``): the host-side bookkeeping ``forward`` would have done."""

    def after_graph_step(self, kv: Any, chunks: list[ScheduledChunk]) -> None:  # noqa: B027
        """After a replayed decode step: host-driven device work ``forward`` would have done
        after the model (e.g. copies out of per-slot state the graph updated)."""

    def reset(self, kv: Any) -> None:  # noqa: B027 - optional hook
        """After the warm-up: forget every per-sequence state it left."""


def family_class(cfg: ModelConfig) -> type[ModelFamily]:
    """The ModelFamily subclass that serves ``cfg.family`` (``registry.IMPLEMENTATIONS``). The
    implementation is imported by name, so this contract never imports a family itself."""
    target = IMPLEMENTATIONS.get(cfg.family)
    if target is None:
        raise CheckpointError(f"model family {cfg.family!r} is not served yet")
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)
