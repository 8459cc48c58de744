"""The dense families (Llama, Qwen2, Qwen3) behind the ModelFamily contract: K/V of every token
in paged blocks (engine/kv_cache.py), the plan terms of a dense decoder, CUDA-graph decode."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import torch

from engine.attention import AttentionShape, attention_workspace_bytes
from engine.config import EngineConfig
from engine.config_resolve import resolve_engine_config
from engine.errors import CheckpointError
from engine.kv_cache import KVCache, KVCacheSpec, kv_storage_dtype
from engine.kv_layout import CacheKind, KVLayout
from engine.memory_plan import PlanTerm
from engine.memory_planner import GRAPH_POOL_SLACK, common_step_terms
from engine.model_config import ModelConfig
from engine.models.dense import DenseDecoder
from engine.models.family import ModelFamily
from engine.models.registry import DENSE_TRAITS
from engine.parallel.shard_plan import ShardPlan
from engine.rope import RotaryTable
from engine.step_batch import StepBatch
from engine.workspace import Workspace


class DenseKVLayout(KVLayout):
    """K and V of each token, per layer: ``KVCache.data[L, 2, num_blocks, block_size, H, D]``,
    in the model dtype (kv_dtype=auto) or FP8 e4m3fn (kv_dtype=fp8, kernels/kv_quant.py): one
    byte an element and no scales, so an FP8 block is half a bf16 one and moves as raw bytes."""

    def __init__(self, cfg: ModelConfig, ec: EngineConfig) -> None:
        self.block_size = ec.block_size
        dtype = kv_storage_dtype(ec.kv_dtype, ec.torch_dtype)
        self.spec_for = lambda n: KVCacheSpec(cfg.num_layers, n, ec.block_size, cfg.num_kv_heads,
                                              cfg.head_dim, dtype)
        self._spec = self.spec_for(2)

    @property
    def kinds(self) -> tuple[CacheKind, ...]:
        s = self._spec
        elem = torch.empty((), dtype=s.dtype).element_size()
        return (CacheKind("k_and_v", s.num_layers, 2 * s.block_size,
                          s.num_kv_heads * s.head_dim * elem),)

    @property
    def fingerprint(self) -> str:
        return self._spec.layout_fingerprint

    def allocate(self, num_blocks: int, device: torch.device) -> KVCache:
        return KVCache(self.spec_for(num_blocks), device)

    # Blocks move as the bytes they hold, whatever the stored dtype: a uint8 view of the cache
    # ([L, 2, blocks, B, H, D x elem]) copies them bit for bit, FP8 included (PyTorch's CPU
    # index_copy_ has no FP8 kernel, and no dtype conversion may touch stored values).
    def export_blocks(self, kv: KVCache, block_ids: list[int]) -> torch.Tensor:
        raw = kv.data.view(torch.uint8)
        idx = torch.as_tensor(block_ids, dtype=torch.long, device=raw.device)
        blocks = raw.index_select(2, idx).transpose(0, 2).contiguous()  # [n, 2, L, B, H, D x e]
        return blocks.view(len(block_ids), -1)

    def import_blocks(self, kv: KVCache, block_ids: list[int], data: torch.Tensor) -> None:
        raw = kv.data.view(torch.uint8)
        idx = torch.as_tensor(block_ids, dtype=torch.long, device=raw.device)
        src = data.to(raw.device).contiguous().view(torch.uint8).view(
            len(block_ids), raw.shape[1], raw.shape[0], *raw.shape[3:]).transpose(0, 2)
        raw.index_copy_(2, idx, src)


def dense_weight_bytes(cfg: ModelConfig, elem: int) -> int:
    h, q, kv, i, v = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.vocab_size
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
    if cfg.attention_bias:
        per_layer += q + 2 * kv
    if cfg.qk_norm:
        per_layer += 2 * cfg.head_dim
    total = v * h + cfg.num_layers * per_layer + h
    if not cfg.tie_word_embeddings:
        total += v * h
    return total * elem


def dense_activation_bytes(cfg: ModelConfig, chunk: int, max_batch: int, elem: int) -> int:
    """Upper bound of the transient tensors of one layer at ``chunk`` tokens (eager PyTorch)."""
    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    per_token = (6 * h + 5 * q + 4 * kv + 4 * i) * elem + 2 * h * 4
    logits = max_batch * (cfg.vocab_size * elem + h * 4)
    return chunk * per_token + logits


class DenseFamily(ModelFamily):
    uses_cuda_graphs: ClassVar[bool] = True
    # K/V of every token in its own slot: a rejected draft's slot is simply written again
    speculation_problem: ClassVar[str | None] = None
    supports_tensor_parallel: ClassVar[bool] = True

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], ec: EngineConfig,
                 tp: Any = None) -> None:
        rope = RotaryTable(cfg.rope, cfg.head_dim, ec.max_context, cfg.max_position_embeddings,
                           ec.torch_dtype, ec.torch_device)
        shape = AttentionShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, ec.block_size,
                               ec.attn_tile_tokens)
        self.decoder = DenseDecoder(cfg, weights, rope, shape, fused=ec.use_triton_attention, tp=tp)

    @classmethod
    def rank_model_config(cls, cfg: ModelConfig, size: int) -> ModelConfig:
        return ShardPlan(cfg, 0, size).rank_config

    @classmethod
    def tensor_slicer(cls, cfg: ModelConfig, rank: int, size: int,
                      shapes: Mapping[str, tuple[int, ...]]) -> Any:
        return ShardPlan(cfg, rank, size).slice_of

    @classmethod
    def kv_layout(cls, cfg: ModelConfig, ec: EngineConfig) -> DenseKVLayout:
        return DenseKVLayout(cfg, ec if ec.is_resolved else resolve_engine_config(ec, cfg))

    @classmethod
    def checkpoint_tensors(cls, cfg: ModelConfig,
                           present: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        return expected_tensor_shapes(cfg)

    @classmethod
    def dummy_tensors(cls, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                      seed: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Normal(0, 0.02) matrices, unit norms, zero biases, in ``dtype``: how transformers
        initialises these models. One generator over the checkpoint's tensors in name order."""
        qc = cfg.hf_config.get("quantization_config")
        if qc:
            method = qc.get("quant_method") if isinstance(qc, dict) else qc
            raise CheckpointError(f"quantization_config quant_method={method!r}: the dense "
                                  "families serve unquantized checkpoints (and GGUF files) only")
        meta = torch.device(device).type == "meta"
        gen = None if meta else torch.Generator(device=device).manual_seed(seed)
        for name, shape in sorted(expected_tensor_shapes(cfg).items()):
            t = torch.empty(shape, dtype=dtype, device=device)
            if not meta:
                if name.endswith("norm.weight"):
                    t.fill_(1.0)
                elif name.endswith(".bias"):
                    t.zero_()
                else:
                    t.normal_(0.0, 0.02, generator=gen)
            yield name, t

    @classmethod
    def plan_terms(cls, cfg: ModelConfig, ec: EngineConfig,
                   weight_bytes: int | None) -> list[PlanTerm]:
        elem = torch.empty((), dtype=ec.torch_dtype).element_size()
        kv_dtype = kv_storage_dtype(ec.kv_dtype, ec.torch_dtype)
        attn = AttentionShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, ec.block_size,
                              ec.attn_tile_tokens)
        terms = [
            PlanTerm("weights", weight_bytes if weight_bytes is not None
                     else dense_weight_bytes(cfg, elem),
                     "embed + layers x (qkv + o + 3 mlp + norms) + lm_head, x dtype bytes"),
            PlanTerm("ws.attention", 0, "Triton paged attention keeps its tiles on chip", True)
            if ec.use_triton_attention else
            PlanTerm("ws.attention", attention_workspace_bytes(attn, ec.chunk_tokens,
                                                               ec.max_batch, kv_dtype),
                     f"max(chunk {ec.chunk_tokens} x 1 seq, 1 x batch {ec.max_batch}) x heads x "
                     f"tile {ec.attn_tile_tokens} (fp32 scores, K/V tiles as stored "
                     f"({str(kv_dtype).removeprefix('torch.')}) and in fp32, accumulators)",
                     True),
            *common_step_terms(cfg, ec),
            PlanTerm("rope_tables", 2 * ec.max_context * cfg.head_dim * elem,
                     f"2 x max_context {ec.max_context} x head_dim x {elem} B"),
            PlanTerm("activations", dense_activation_bytes(cfg, ec.chunk_tokens,
                                                           ec.verify_rows, elem),
                     f"chunk {ec.chunk_tokens} x (6h + 5q + 4kv + 4i) x {elem} B + fp32 norms"
                     f" + logits rows {ec.verify_rows} x vocab"),
        ]
        if ec.use_cuda_graphs:
            terms.append(PlanTerm(
                "cuda_graph_pool",
                dense_activation_bytes(cfg, ec.max_batch, ec.max_batch, elem) + GRAPH_POOL_SLACK,
                f"activations of a {ec.max_batch}-token decode step + 42 MiB allocator segment "
                "granularity (one 2 MiB small-pool and two 20 MiB large-pool segments)"))
        return terms

    def forward(self, batch: StepBatch, kv: KVCache, ws: Workspace) -> torch.Tensor:
        return self.decoder.forward(batch, kv, ws)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return self.decoder.compute_logits(hidden, out)


def expected_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a dense model needs, with its HF shape."""
    traits = DENSE_TRAITS.get(cfg.family)
    if traits is None:
        raise CheckpointError(f"no dense tensor layout for family {cfg.family!r}")
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
        if cfg.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
            }
            if traits["o_proj_bias"]:
                shapes[p + "self_attn.o_proj.bias"] = (h,)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (cfg.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (cfg.head_dim,)
    return shapes
