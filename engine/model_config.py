"""What the engine needs to know about a model's shape, parsed once from config.json (or GGUF
metadata, see engine/gguf_loader.py).

Never touches weights or devices: a ModelConfig is plain data, so the memory planner can size a
model it has never loaded (``bulkhead plan`` on a bare config.json).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import CheckpointError
from engine.models.registry import ARCHITECTURES as _FAMILIES
from engine.models.registry import DENSE_TRAITS, FAMILIES


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; covers the HF 'default', 'linear', 'llama3' and 'yarn' kinds."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "linear", "llama3", "yarn"):
            raise CheckpointError(f"unsupported rope_type {self.rope_type!r}")

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> RopeConfig:
        """Reads transformers-5 ``rope_parameters`` or the older ``rope_theta`` + ``rope_scaling``."""
        params = d.get("rope_parameters")
        if isinstance(params, dict) and "rope_theta" in params and not _is_per_layer(params):
            scaling = dict(params)
        else:
            scaling = dict(d.get("rope_scaling") or {})
            scaling.setdefault("rope_theta", d.get("rope_theta", 10000.0))
        rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
        kwargs: dict[str, Any] = {"rope_type": rope_type, "theta": float(scaling["rope_theta"])}
        for key in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"):
            if scaling.get(key) is not None:
                kwargs[key] = float(scaling[key])
        for key in ("mscale", "mscale_all_dim"):
            if scaling.get(key) is not None:
                kwargs[key] = float(scaling[key])
        if scaling.get("original_max_position_embeddings") is not None:
            kwargs["original_max_position_embeddings"] = int(
                scaling["original_max_position_embeddings"]
            )
        return cls(**kwargs)


def _is_per_layer(params: dict[str, Any]) -> bool:
    # Some configs key rope parameters by attention type (one dict per kind of layer).
    return all(isinstance(v, dict) for v in params.values())


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only transformer.  ``hf_config`` keeps the raw dict for families with
    fields beyond the common ones (read by the family itself)."""

    family: str  # one of engine.models.registry.FAMILIES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projection bias (models/registry.py DENSE_TRAITS)
    qk_norm: bool = False  # RMSNorm on q and k per head
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    stored_dtype: str = "float32"
    name: str = "model"
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise CheckpointError(f"unknown model family {self.family!r}")
        if self.num_heads % max(self.num_kv_heads, 1) != 0:
            raise CheckpointError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], name: str = "model") -> ModelConfig:
        arch = (d.get("architectures") or [None])[0]
        family = _FAMILIES.get(d.get("model_type", "")) or _FAMILIES.get(arch or "")
        if family is None:
            raise CheckpointError(
                f"unknown architecture: model_type={d.get('model_type')!r} architectures={arch!r}; "
                f"supported: {sorted(set(_FAMILIES.values()))}"
            )
        num_heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        traits = DENSE_TRAITS.get(family, {})
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            family=family,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d.get("intermediate_size") or d.get("moe_intermediate_size")),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(d.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(d),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", traits.get("attention_bias", False))),
            qk_norm=traits.get("qk_norm", False),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            stored_dtype=str(d.get("dtype") or d.get("torch_dtype") or "float32"),
            name=name,
            hf_config=dict(d),
        )

    @classmethod
    def from_json_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"cannot read {path}: {e}") from e
        return cls.from_hf_dict(d, name=path.parent.name)
