"""The memory plan: every byte the engine will hold, decided before the first request.

``make_plan`` computes each term from (model config, dtype, longest chunk, longest context,
largest batch); start-up refuses a plan that does not fit, naming the numbers and what to change.
docs/memory.md gives the formula of each term; keep the two in step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import AttentionShape, attention_workspace_bytes
from engine.config import EngineConfig
from engine.errors import PlanError
from engine.kv_cache import KVCacheSpec
from engine.model_config import ModelConfig
from engine.sampler import sampler_workspace_bytes
from engine.workspace import _align

GiB = 1 << 30
MiB = 1 << 20
GRAPH_POOL_SLACK = 42 * MiB
ALLOCATOR_SLACK = 8 * MiB  # small-pool headroom reserved after warm-up (4 segments)


@dataclass(frozen=True)
class PlanTerm:
    name: str
    bytes: int
    formula: str
    in_workspace: bool = False  # a slice of the workspace arena, not a separate allocation


@dataclass(frozen=True)
class MemoryPlan:
    terms: tuple[PlanTerm, ...]
    device: str
    device_memory_bytes: int
    memory_utilization: float
    kv_spec: KVCacheSpec
    max_context: int
    chunk_tokens: int
    max_batch: int

    def term(self, name: str) -> int:
        return sum(t.bytes for t in self.terms if t.name == name)

    @property
    def workspace_bytes(self) -> int:
        return sum(t.bytes for t in self.terms if t.in_workspace)

    @property
    def total_bytes(self) -> int:
        return sum(t.bytes for t in self.terms)

    @property
    def budget_bytes(self) -> int:
        return int(self.device_memory_bytes * self.memory_utilization)

    @property
    def headroom_bytes(self) -> int:
        return self.budget_bytes - self.total_bytes

    @property
    def fits(self) -> bool:
        return self.headroom_bytes >= 0

    def check(self) -> None:
        if self.fits:
            return
        kv = self.term("kv_cache")
        raise PlanError(
            f"memory plan does not fit: needs {self.total_bytes / GiB:.2f} GiB, budget is "
            f"{self.budget_bytes / GiB:.2f} GiB ({self.memory_utilization:.0%} of "
            f"{self.device_memory_bytes / GiB:.2f} GiB on {self.device}). Largest terms: "
            + ", ".join(f"{t.name}={t.bytes / GiB:.2f} GiB"
                        for t in sorted(self.terms, key=lambda t: -t.bytes)[:3])
            + f". Lower max_context ({self.max_context}), max_batch ({self.max_batch}) or "
            f"num_blocks (KV is {kv / GiB:.2f} GiB), lower chunk_tokens ({self.chunk_tokens}), "
            "or use a smaller dtype.")

    def to_json(self) -> dict:
        return {
            "device": self.device,
            "device_memory_bytes": self.device_memory_bytes,
            "memory_utilization": self.memory_utilization,
            "budget_bytes": self.budget_bytes,
            "total_bytes": self.total_bytes,
            "headroom_bytes": self.headroom_bytes,
            "max_context": self.max_context,
            "chunk_tokens": self.chunk_tokens,
            "max_batch": self.max_batch,
            "num_blocks": self.kv_spec.num_blocks,
            "block_size": self.kv_spec.block_size,
            "kv_bytes_per_token": self.kv_spec.bytes_per_token,
            "terms": [{"name": t.name, "bytes": t.bytes, "formula": t.formula,
                       "in_workspace": t.in_workspace} for t in self.terms],
        }

    def table(self) -> str:
        rows = [f"{'term':<22}{'bytes':>16}{'GiB':>10}  formula"]
        for t in self.terms:
            rows.append(f"{t.name:<22}{t.bytes:>16,}{t.bytes / GiB:>10.3f}  {t.formula}")
        rows.append(f"{'total':<22}{self.total_bytes:>16,}{self.total_bytes / GiB:>10.3f}")
        rows.append(f"{'budget':<22}{self.budget_bytes:>16,}{self.budget_bytes / GiB:>10.3f}  "
                    f"{self.memory_utilization} x {self.device_memory_bytes:,} ({self.device})")
        rows.append(f"{'headroom':<22}{self.headroom_bytes:>16,}{self.headroom_bytes / GiB:>10.3f}")
        return "\n".join(rows)


def step_inputs_term(ec: EngineConfig) -> PlanTerm:
    """Step inputs staged in the workspace: token ids, positions, KV slots (int64 per token),
    logits rows (int64 per sequence) and, for the kernels, block tables, query offsets and
    context lengths (int32)."""
    tokens = ec.chunk_tokens
    seqs = min(ec.max_batch, ec.chunk_tokens)
    nbytes = (3 * _align(tokens * 8) + _align(seqs * 8) + _align(seqs * ec.blocks_per_seq * 4)
              + _align((seqs + 1) * 4) + _align(seqs * 4))
    return PlanTerm("ws.step_inputs", nbytes,
                    f"3 x chunk {tokens} x 8 B + min(batch, chunk) {seqs} x (8 + blocks_per_seq "
                    f"{ec.blocks_per_seq} x 4 + 8) B", True)


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


def make_plan(model: ModelConfig, ec: EngineConfig, device_memory_bytes: int,
              weight_bytes: int | None = None, non_torch_bytes: int = 0,
              library_bytes: int = 0, device_label: str | None = None) -> MemoryPlan:
    dtype = ec.torch_dtype
    elem = torch.empty((), dtype=dtype).element_size()
    if model.family == "deepseek_v4":
        return _deepseek_v4_plan(model, ec, device_memory_bytes, weight_bytes, non_torch_bytes,
                                 library_bytes, device_label)
    kv_spec = KVCacheSpec(model.num_layers, ec.resolved_num_blocks, ec.block_size,
                          model.num_kv_heads, model.head_dim, dtype)
    attn = AttentionShape(model.num_heads, model.num_kv_heads, model.head_dim, ec.block_size,
                          ec.attn_tile_tokens)
    terms = [
        PlanTerm("weights", weight_bytes if weight_bytes is not None
                 else dense_weight_bytes(model, elem),
                 "embed + layers x (qkv + o + 3 mlp + norms) + lm_head, x dtype bytes"),
        PlanTerm("kv_cache", kv_spec.total_bytes,
                 f"num_blocks {kv_spec.num_blocks} x block_size {ec.block_size} x layers "
                 f"{model.num_layers} x 2 x kv_heads {model.num_kv_heads} x head_dim "
                 f"{model.head_dim} x {elem} B"),
        PlanTerm("ws.attention", 0, "Triton paged attention keeps its tiles on chip", True)
        if ec.use_triton_attention else
        PlanTerm("ws.attention", attention_workspace_bytes(attn, ec.chunk_tokens, ec.max_batch,
                                                           dtype),
                 f"max(chunk {ec.chunk_tokens} x 1 seq, 1 x batch {ec.max_batch}) x heads x tile "
                 f"{ec.attn_tile_tokens} (fp32 scores, K/V tiles, accumulators)", True),
        PlanTerm("ws.logits", _align(ec.max_batch * model.vocab_size * 4),
                 f"max_batch {ec.max_batch} x vocab {model.vocab_size} x 4 B", True),
        PlanTerm("ws.sampler", _align(sampler_workspace_bytes(model.vocab_size)),
                 "vocab x (4 + 8 + 4) B", True),
        step_inputs_term(ec),
        PlanTerm("rope_tables", 2 * ec.max_context * model.head_dim * elem,
                 f"2 x max_context {ec.max_context} x head_dim x {elem} B"),
        PlanTerm("activations", dense_activation_bytes(model, ec.chunk_tokens, ec.max_batch, elem),
                 f"chunk {ec.chunk_tokens} x (6h + 5q + 4kv + 4i) x {elem} B + fp32 norms"
                 " + max_batch x vocab logits"),
    ]
    if ec.use_cuda_graphs:
        terms.append(PlanTerm(
            "cuda_graph_pool",
            dense_activation_bytes(model, ec.max_batch, ec.max_batch, elem) + GRAPH_POOL_SLACK,
            f"activations of a {ec.max_batch}-token decode step + 42 MiB allocator segment "
            "granularity (one 2 MiB small-pool and two 20 MiB large-pool segments)"))
    return _finish_plan(terms, ec, kv_spec, device_memory_bytes, library_bytes, non_torch_bytes,
                        device_label)


def _deepseek_v4_plan(model: ModelConfig, ec: EngineConfig, device_memory_bytes: int,
                      weight_bytes: int | None, non_torch_bytes: int, library_bytes: int,
                      device_label: str | None) -> MemoryPlan:
    """DeepSeek-V4: its state is per sequence slot (sliding window, compressed entries, indexer
    keys, compressor carry-over), sized by the family's own functions; the paged pool only
    counts tokens for admission (zero layers, zero bytes)."""
    from engine.models.deepseek_v4.cache_state import deepseek_v4_cache_bytes
    from engine.models.deepseek_v4.config import DeepseekV4Config
    from engine.models.deepseek_v4.quant_weights import has_fp8_linears, has_mxfp4_experts
    from engine.models.deepseek_v4.sizing import (
        deepseek_v4_step_peak_bytes,
        deepseek_v4_step_scratch_bytes,
        deepseek_v4_weight_bytes,
        deepseek_v4_workspace_bytes,
    )

    dtype = ec.torch_dtype
    cfg = DeepseekV4Config.from_hf_dict(model.hf_config)
    kernels = ec.use_triton_attention
    kv_spec = KVCacheSpec(0, ec.resolved_num_blocks, ec.block_size, 1, 1, dtype)
    fp8, fp4 = has_fp8_linears(model.hf_config), has_mxfp4_experts(model.hf_config)
    if weight_bytes is None:  # no weights read (bulkhead plan): from the config
        weight_bytes = deepseek_v4_weight_bytes(cfg, dtype, fp8, fp4, ec.weight_format)
        kept = ec.weight_format == "checkpoint"
        weights_note = (f"from the config: {dtype} tensors"
                        + (", FP8 projections 1 B + fp32 per 128x128" if fp8 and kept else "")
                        + (", MXFP4 experts 0.5 B + 1 B per 32" if fp4 and kept else ""))
    else:
        weights_note = f"as the model holds them (weight_format {ec.weight_format})"
    terms = [PlanTerm("weights", weight_bytes, weights_note)]
    for name, nbytes in deepseek_v4_cache_bytes(cfg, ec.max_batch, ec.max_context, dtype).items():
        terms.append(PlanTerm(f"state.{name}", nbytes,
                              f"per slot x max_batch {ec.max_batch} at max_context {ec.max_context}"))
    scratch = deepseek_v4_step_scratch_bytes(cfg, ec.chunk_tokens, ec.max_context, ec.max_batch,
                                             dtype, "kernels" if kernels else "torch")
    # the fused MXFP4 MoE runs wherever the GEMM kernels do (CUDA), whatever attention runs
    mxfp4 = ec.weight_format == "checkpoint" and fp4 and ec.torch_device.type == "cuda"
    if kernels or mxfp4:
        terms.append(PlanTerm("ws.indexer", _align(deepseek_v4_workspace_bytes(
            cfg, max(ec.chunk_tokens, ec.max_batch), ec.max_context, mxfp4, dtype, kernels)),
            "max(tiled indexer top-k scratch + [rows, topk] outputs, fused MXFP4 MoE scratch: "
            "tokens x top_k x (16 + (hidden + intermediate) x dtype) B) (kernels' size functions)",
            True))
    terms += [
        PlanTerm("ws.logits", _align(ec.max_batch * model.vocab_size * 4),
                 f"max_batch {ec.max_batch} x vocab {model.vocab_size} x 4 B", True),
        PlanTerm("ws.sampler", _align(sampler_workspace_bytes(model.vocab_size)),
                 "vocab x (4 + 8 + 4) B", True),
        step_inputs_term(ec),
        PlanTerm("activations", deepseek_v4_step_peak_bytes(scratch),
                 "mHC streams + max(attention parts, MoE, final norm) at chunk "
                 f"{ec.chunk_tokens} against {ec.max_context}: "
                 + ", ".join(f"{k}={v}" for k, v in scratch.items())),
    ]
    return _finish_plan(terms, ec, kv_spec, device_memory_bytes, library_bytes, non_torch_bytes,
                        device_label)


def _finish_plan(terms: list[PlanTerm], ec: EngineConfig, kv_spec: KVCacheSpec,
                 device_memory_bytes: int, library_bytes: int, non_torch_bytes: int,
                 device_label: str | None) -> MemoryPlan:
    """Add the terms measured on the device (not derived from the config) and build the plan."""
    if ec.torch_device.type == "cuda":
        terms.append(PlanTerm(
            "allocator_slack", ALLOCATOR_SLACK,
            "free small-pool segments the warm-up leaves cached: a step whose small tensors pack "
            "differently from the warm-up's uses them instead of a new cudaMalloc"))
    if library_bytes:
        terms.append(PlanTerm("library_workspaces", library_bytes,
                              "cuBLAS/cuBLASLt workspaces, measured by probe matmuls at start-up"))
    if non_torch_bytes:
        terms.append(PlanTerm("non_torch", non_torch_bytes,
                              "CUDA context and libraries, measured before loading"))
    return MemoryPlan(tuple(terms), device_label or str(ec.torch_device), device_memory_bytes,
                      ec.memory_utilization, kv_spec, ec.max_context, ec.chunk_tokens, ec.max_batch)


def reserve_allocator_slack(device: torch.device, nbytes: int) -> None:
    """Leave at least ``nbytes`` of free small-pool blocks in the caching allocator (start-up
    only, after the warm-up): allocate 512 KiB tensors, which the allocator packs four to a
    2 MiB small-pool segment, then free them; the segments stay cached for serving."""
    blocks = [torch.empty(512 * 1024, dtype=torch.uint8, device=device)
              for _ in range(nbytes // (512 * 1024))]
    del blocks


def library_workspaces(ec: EngineConfig) -> int:
    """Bytes that cuBLAS takes from the caching allocator for its workspaces on first use (32 MiB
    per handle and stream on Hopper): measured by running each matmul flavour once, before the
    warm-up, so they are a term of the plan and not a surprise in the first step."""
    dev = ec.torch_device
    if dev.type != "cuda":
        return 0
    torch.cuda.synchronize(dev)
    before = torch.cuda.memory_allocated(dev)
    for dt in {ec.torch_dtype, torch.float32}:
        a = torch.ones(64, 64, dtype=dt, device=dev)
        torch.nn.functional.linear(a, a)
        torch.matmul(a.view(1, 64, 64), a.view(1, 64, 64))
        del a
    torch.cuda.synchronize(dev)
    return torch.cuda.memory_allocated(dev) - before


def device_memory(ec: EngineConfig) -> int:
    if ec.device_memory_bytes is not None:
        return ec.device_memory_bytes
    dev = ec.torch_device
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).total_memory
    import os
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
