"""DeepSeek-V4 shape and hyper-parameters, parsed once from an HF config.json dict.

Mirrors how transformers 5.24's ``DeepseekV4Config.__post_init__`` folds legacy fields
(``compress_ratios``, ``compress_rate_csa``/``compress_rate_hca``, ``num_hash_layers``,
``qk_rope_head_dim``, flat ``rope_scaling``) into the modern ones, so a checkpoint written by any
version yields the same model. Plain data: never touches weights or devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.errors import CheckpointError
from engine.rope import yarn_frequencies

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_LAYER_TYPES = ("hash_moe", "moe")
_RATIO_TO_LAYER_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
_SCORING = ("sqrtsoftplus", "softmax", "sigmoid")


@dataclass(frozen=True)
class RopeParams:
    """One of V4's two rotary flavours ("main" for sliding layers, "compress" for CSA/HCA)."""

    theta: float
    rope_type: str = "default"  # "default" | "yarn"
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "yarn"):
            raise CheckpointError(f"deepseek_v4: unsupported rope_type {self.rope_type!r}")
        if self.rope_type == "yarn" and self.original_max_position_embeddings is None:
            raise CheckpointError("deepseek_v4: yarn rope needs original_max_position_embeddings")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RopeParams:
        rope_type = d.get("rope_type", d.get("type", "default")) or "default"
        omax = d.get("original_max_position_embeddings")
        return cls(
            theta=float(d["rope_theta"]),
            rope_type=rope_type,
            factor=None if d.get("factor") is None else float(d["factor"]),
            original_max_position_embeddings=None if omax is None else int(omax),
            beta_fast=float(d.get("beta_fast") or 32.0),
            beta_slow=float(d.get("beta_slow") or 1.0),
            attention_factor=(
                None if d.get("attention_factor") is None else float(d["attention_factor"])
            ),
            mscale=None if d.get("mscale") is None else float(d["mscale"]),
            mscale_all_dim=None if d.get("mscale_all_dim") is None else float(d["mscale_all_dim"]),
        )

    def inv_freq_and_scale(self, rope_dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
        """``inv_freq [rope_dim // 2]`` (fp32) and the cos/sin multiplier, as transformers
        computes them (yarn with ``truncate=True``: V4's nested rope dict has no top-level key)."""
        if self.rope_type == "default":
            exps = torch.arange(0, rope_dim, 2, dtype=torch.float) / rope_dim
            return 1.0 / self.theta**exps, 1.0
        assert self.original_max_position_embeddings is not None
        omax = self.original_max_position_embeddings
        factor = self.factor if self.factor is not None else max_positions / omax
        return yarn_frequencies(self.theta, rope_dim, factor, omax, self.beta_fast,
                                self.beta_slow, self.mscale, self.mscale_all_dim,
                                self.attention_factor)


@dataclass(frozen=True)
class DeepseekV4Config:
    """Everything the DeepSeek-V4 family needs; build with :meth:`from_hf_dict`."""

    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    q_lora_rank: int
    rope_head_dim: int
    num_experts_per_tok: int
    n_routed_experts: int
    scoring_func: str
    routed_scaling_factor: float
    max_position_embeddings: int
    layer_types: tuple[str, ...]
    csa_rate: int
    hca_rate: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    mlp_layer_types: tuple[str, ...]
    swiglu_limit: float
    sliding_window: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    main_rope: RopeParams
    compress_rope: RopeParams
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name, types, allowed in (
            ("layer_types", self.layer_types, LAYER_TYPES),
            ("mlp_layer_types", self.mlp_layer_types, MLP_LAYER_TYPES),
        ):
            if len(types) != self.num_layers:
                raise CheckpointError(
                    f"deepseek_v4: len({name})={len(types)} != num_hidden_layers={self.num_layers}"
                )
            bad = [t for t in types if t not in allowed]
            if bad:
                raise CheckpointError(f"deepseek_v4: {name} entries must be in {allowed}; got {bad}")
        if self.scoring_func not in _SCORING:
            raise CheckpointError(f"deepseek_v4: scoring_func {self.scoring_func!r} not in {_SCORING}")
        if (self.num_heads * self.head_dim) % self.o_groups:
            raise CheckpointError(
                f"deepseek_v4: num_attention_heads*head_dim={self.num_heads * self.head_dim} is not "
                f"divisible by o_groups={self.o_groups}"
            )
        if self.rope_head_dim % 2 or not 0 < self.rope_head_dim <= min(self.head_dim, self.index_head_dim):
            raise CheckpointError(
                f"deepseek_v4: rope head dim {self.rope_head_dim} must be even and fit head_dim="
                f"{self.head_dim} and index_head_dim={self.index_head_dim}"
            )
        if self.csa_rate < 1 or self.hca_rate < 1 or self.sliding_window < 1:
            raise CheckpointError("deepseek_v4: compress rates and sliding_window must be >= 1")

    def rate(self, layer_type: str) -> int:
        """Compression rate of a layer type (0 for sliding-only layers)."""
        return {SLIDING: 0, CSA: self.csa_rate, HCA: self.hca_rate}[layer_type]

    @property
    def uses_csa(self) -> bool:
        return CSA in self.layer_types

    @classmethod
    def coerce(cls, cfg: Any) -> DeepseekV4Config:
        """A DeepseekV4Config as is; an engine ModelConfig (family deepseek_v4) via its raw
        ``hf_config``; a plain dict as config.json."""
        if isinstance(cfg, cls):
            return cfg
        if isinstance(cfg, dict):
            return cls.from_hf_dict(cfg)
        hf = getattr(cfg, "hf_config", None)
        if getattr(cfg, "family", None) != "deepseek_v4" or not isinstance(hf, dict):
            raise CheckpointError(f"deepseek_v4: cannot read a DeepSeek-V4 config from {type(cfg).__name__}")
        return cls.from_hf_dict(hf)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> DeepseekV4Config:
        """Parse a config.json dict (transformers-5 or legacy DeepSeek field names)."""
        n = int(d["num_hidden_layers"])
        head_dim = int(d.get("head_dim") or 512)
        rates = dict(d.get("compress_rates") or {CSA: 4, HCA: 128})
        if d.get("compress_rate_csa") is not None:
            rates[CSA] = int(d["compress_rate_csa"])
        if d.get("compress_rate_hca") is not None:
            rates[HCA] = int(d["compress_rate_hca"])
        layer_types = d.get("layer_types")
        if layer_types is None and d.get("compress_ratios") is not None:
            try:
                layer_types = [_RATIO_TO_LAYER_TYPE[int(r)] for r in d["compress_ratios"]]
            except KeyError as e:
                raise CheckpointError(f"deepseek_v4: unknown compress ratio {e} in compress_ratios") from e
        if layer_types is None:
            inter = [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
            layer_types = [HCA] * min(n, 2) + inter
        mlp_types = d.get("mlp_layer_types")
        if mlp_types is None:
            n_hash = d.get("num_hash_layers")
            n_hash = 3 if n_hash is None else int(n_hash)
            mlp_types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
        prf = d.get("partial_rotary_factor")
        if prf is None:
            qk_rope = d.get("qk_rope_head_dim")
            prf = qk_rope / head_dim if qk_rope is not None else 64 / 512
        rope_dim = int(head_dim * float(prf))
        main_rope, compress_rope = _rope_params(d)
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=int(d.get("vocab_size", 129280)),
            hidden_size=int(d.get("hidden_size", 4096)),
            moe_intermediate_size=int(d.get("moe_intermediate_size", 2048)),
            num_layers=n,
            num_heads=int(d.get("num_attention_heads", 64)),
            head_dim=head_dim,
            q_lora_rank=int(d.get("q_lora_rank", 1024)),
            rope_head_dim=rope_dim,
            num_experts_per_tok=int(d.get("num_experts_per_tok", 6)),
            n_routed_experts=int(d.get("n_routed_experts", 256)),
            scoring_func=str(d.get("scoring_func", "sqrtsoftplus")),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.5)),
            max_position_embeddings=int(d.get("max_position_embeddings", 1048576)),
            layer_types=tuple(layer_types[:n]),
            csa_rate=int(rates[CSA]),
            hca_rate=int(rates[HCA]),
            hc_mult=int(d.get("hc_mult", 4)),
            hc_sinkhorn_iters=int(d.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(d.get("hc_eps", 1e-6)),
            mlp_layer_types=tuple(mlp_types[:n]),
            swiglu_limit=float(d.get("swiglu_limit", 10.0)),
            sliding_window=int(d.get("sliding_window", 128)),
            o_groups=int(d.get("o_groups", 8)),
            o_lora_rank=int(d.get("o_lora_rank", 1024)),
            index_n_heads=int(d.get("index_n_heads", 64)),
            index_head_dim=int(d.get("index_head_dim", 128)),
            index_topk=int(d.get("index_topk", 512)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            main_rope=main_rope,
            compress_rope=compress_rope,
            eos_token_ids=eos_ids,
        )


def _rope_params(d: dict[str, Any]) -> tuple[RopeParams, RopeParams]:
    """Main rope: plain RoPE at ``rope_theta``. Compress rope: ``compress_rope_theta`` plus any
    flat scaling keys (yarn), with ``attention_factor`` forced to 1.0 for yarn (as transformers)."""
    rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        return RopeParams.from_dict(rp["main"]), RopeParams.from_dict(rp["compress"])
    flat = {k: v for k, v in rp.items() if k not in ("main", "compress")}
    main = {"rope_type": "default", "rope_theta": float(d.get("rope_theta", 10000.0))}
    compress = {**flat, "rope_theta": float(d.get("compress_rope_theta", 160000.0))}
    compress.setdefault("rope_type", compress.pop("type", "default"))
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return RopeParams.from_dict(main), RopeParams.from_dict(compress)
