"""Which slice of each dense tensor a rank holds, and the per-rank model shape.

The Megatron split: q/k/v and gate/up are column-parallel (each rank holds a run of output rows:
whole heads, a run of the intermediate size), o and down are row-parallel (the matching input
columns; their partial sums are all-reduced). KV heads are split when there are at least as many
as ranks, otherwise each is replicated on ``tp / num_kv_heads`` consecutive ranks. The
embedding, the norms and lm_head are replicated: the vocabularies of the dense families are
small beside their layers, and a replicated head lets rank 0 sample with no gather. Nothing here
touches a tensor; it only computes shapes and ranges.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.checkpoint import load_model_config
from engine.config import EngineConfig
from engine.errors import PlanError
from engine.model_config import ModelConfig
from engine.models.family import family_class

# The tensor suffixes of each kind of split (the HF names of the dense families).
_COLUMN_Q = ("self_attn.q_proj.weight", "self_attn.q_proj.bias")
_COLUMN_KV = ("self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight",
              "self_attn.v_proj.bias")
_COLUMN_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
_ROW_O = ("self_attn.o_proj.weight",)
_ROW_MLP = ("mlp.down_proj.weight",)
_RANK0_ONLY = ("self_attn.o_proj.bias",)  # added once, after the all-reduce would sum it tp times


@dataclass(frozen=True)
class TensorSlice:
    """Rows ``[start, start + length)`` of dimension ``dim``; ``zero`` = the rank holds zeros
    of the tensor's shape (a bias only rank 0 adds); ``absent`` = the rank does not read the
    tensor at all (another rank's expert)."""

    dim: int
    start: int
    length: int
    zero: bool = False
    absent: bool = False


ABSENT = TensorSlice(0, 0, 0, absent=True)


@dataclass(frozen=True)
class ShardPlan:
    """Rank ``rank`` of ``size`` for one dense model config."""

    cfg: ModelConfig
    rank: int
    size: int

    def __post_init__(self) -> None:
        check_dense_split(self.cfg, self.size)
        assert 0 <= self.rank < self.size

    @property
    def kv_replicas(self) -> int:
        """Ranks that hold each KV head (1 when the heads are split)."""
        return max(self.size // self.cfg.num_kv_heads, 1)

    @property
    def rank_config(self) -> ModelConfig:
        """The model as this rank sees it: a share of the heads and of the intermediate size."""
        c = self.cfg
        return dataclasses.replace(c, num_heads=c.num_heads // self.size,
                                   num_kv_heads=max(c.num_kv_heads // self.size, 1),
                                   intermediate_size=c.intermediate_size // self.size)

    def kv_heads(self, rank: int | None = None) -> range:
        """The global KV heads ``rank`` (default: this one) holds."""
        r = self.rank if rank is None else rank
        per = self.rank_config.num_kv_heads
        first = (r // self.kv_replicas) * per
        return range(first, first + per)

    def slice_of(self, name: str) -> TensorSlice | None:
        """The part of tensor ``name`` this rank loads; None = the whole tensor (replicated)."""
        c, r = self.cfg, self.rank
        rc = self.rank_config
        d = c.head_dim
        if name.endswith(_COLUMN_Q):
            return TensorSlice(0, r * rc.num_heads * d, rc.num_heads * d)
        if name.endswith(_COLUMN_KV):
            heads = self.kv_heads()
            return TensorSlice(0, heads.start * d, len(heads) * d)
        if name.endswith(_COLUMN_MLP):
            return TensorSlice(0, r * rc.intermediate_size, rc.intermediate_size)
        if name.endswith(_ROW_O):
            return TensorSlice(1, r * rc.num_heads * d, rc.num_heads * d)
        if name.endswith(_ROW_MLP):
            return TensorSlice(1, r * rc.intermediate_size, rc.intermediate_size)
        if name.endswith(_RANK0_ONLY) and r != 0:
            return TensorSlice(0, 0, c.hidden_size, zero=True)
        return None


def check_dense_split(cfg: ModelConfig, size: int) -> None:
    """Refuse a tensor-parallel size the model's shape cannot be split by, naming the field."""
    if size < 1:
        raise PlanError(f"tensor_parallel_size must be >= 1, got {size}")
    problems = []
    if cfg.num_heads % size:
        problems.append(f"num_attention_heads={cfg.num_heads}")
    if cfg.intermediate_size % size:
        problems.append(f"intermediate_size={cfg.intermediate_size}")
    kv = cfg.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        problems.append(f"num_key_value_heads={kv} (must divide or be divided by it)")
    if problems:
        raise PlanError(f"tensor_parallel_size={size} does not split {cfg.name}: "
                        + ", ".join(problems) + f" is not a multiple of {size}")


def check_tensor_parallel(ec: EngineConfig) -> None:
    """Before any rank starts: the model's family splits, and by this size (reads config.json
    only)."""
    cfg = load_model_config(ec.model)
    family = family_class(cfg)
    if not family.supports_tensor_parallel:
        raise PlanError(f"tensor_parallel_size={ec.tensor_parallel_size}: family {cfg.family} "
                        f"({cfg.name}) does not split over ranks yet; run it with 1")
    family.rank_model_config(cfg, ec.tensor_parallel_size)  # raises naming the field
