"""DeepSeek-V4 behind the engine's ModelFamily contract: its KV layout (blocks of
:mod:`.memory.kv_pool`), its plan terms, and the step adapter that binds a running sequence to a
slot of per-sequence carry: a sequence's first chunk either starts from nothing or resumes at a
block boundary from its blocks (a prefix hit or an import); any other step must continue exactly
where the slot stands, or it is refused (a scheduling bug, not a request error).

Never allocates cache memory after construction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import torch

from engine.config import EngineConfig
from engine.errors import CheckpointError
from engine.memory_planner import SIDE_LANE_LIBRARY_TERM, PlanTerm, common_step_terms
from engine.model_config import ModelConfig
from engine.models.deepseek_v4.backend import V4Backend
from engine.models.deepseek_v4.config import DeepseekV4Config
from engine.models.deepseek_v4.layers.mtp import V4MTPLayer, mtp_weights_for
from engine.models.deepseek_v4.memory.extent import (
    block_size_problem,
    default_block_size,
    resume_window_bytes,
    slot_carry_bytes,
)
from engine.models.deepseek_v4.memory.kv_layout import V4KVLayout
from engine.models.deepseek_v4.memory.kv_pool import DeepseekV4KVPool
from engine.models.deepseek_v4.memory.sizing import (
    deepseek_v4_decode_peak_bytes,
    deepseek_v4_step_peak_bytes,
    deepseek_v4_step_scratch_bytes,
    deepseek_v4_workspace_bytes,
)
from engine.models.deepseek_v4.memory.step_peak import (
    deepseek_v4_kernels_peak_bytes,
    deepseek_v4_kernels_step_bytes,
)
from engine.models.deepseek_v4.memory.verify_snapshots import VerifySnapshots, bind_slot
from engine.models.deepseek_v4.model import DeepseekV4Model
from engine.models.deepseek_v4.step.decode_rows import DecodeRows
from engine.models.deepseek_v4.step.mtp_drafter import MtpDrafter, MtpRow, speculation_terms
from engine.models.deepseek_v4.weights.checkpoint_specs import dummy_state_dict
from engine.models.deepseek_v4.weights.quant_modules import Mxfp4Experts
from engine.models.deepseek_v4.weights.quant_weights import (
    has_fp8_linears,
    has_mxfp4_experts,
    resident_weight_bytes,
)
from engine.models.deepseek_v4.weights.tensor_parallel import (
    cut_model,
    rank_hf_config,
    whole_hf_config,
    wire_model,
)
from engine.models.deepseek_v4.weights.tensor_slices import renumber_experts, v4_tensor_slicer
from engine.models.deepseek_v4.weights.weight_bytes import deepseek_v4_weight_bytes
from engine.models.family import ModelFamily
from engine.step_batch import StepBatch
from engine.workspace import Workspace, _align

# one 2 MiB small-pool and two 20 MiB large-pool segments, and the side lane's own 2 MiB
# small-pool segment (the allocator gives a stream's blocks to no other stream)
GRAPH_POOL_SLACK = 44 << 20


def _activations_term(v4: DeepseekV4Config, ec: EngineConfig, scratch: dict[str, int],
                      kernels: bool) -> PlanTerm:
    """The step's transient peak: on the kernels path the tensors alive together at each moment
    of the step (step_peak.py; entries bounded by the pool), else the looser part-by-part bound
    of the PyTorch path (sizing.py)."""
    if not kernels:
        return PlanTerm("activations", deepseek_v4_step_peak_bytes(scratch),
                        "mHC streams + max(attention parts, MoE, final norm) at chunk "
                        f"{ec.chunk_tokens} against {ec.max_context}: "
                        + ", ".join(f"{k}={v}" for k, v in scratch.items()))
    kv_tokens = DeepseekV4Family.step_context_limit(ec)
    parts = deepseek_v4_kernels_step_bytes(v4, ec.chunk_tokens, ec.max_context, ec.max_batch,
                                           ec.torch_dtype, kv_tokens, ec.kv_dtype == "fp8",
                                           _plans_fused_decode(ec))
    return PlanTerm("activations", deepseek_v4_kernels_peak_bytes(parts),
                    "max(resident + attention, resident + MoE, mHC mix, mHC merge, final norm) "
                    f"at chunk {ec.chunk_tokens}, batch {ec.max_batch}, context {ec.max_context},"
                    f" entries of at most {kv_tokens} pool tokens: "
                    + ", ".join(f"{k}={v}" for k, v in parts.items()))


def _plans_fused_decode(ec: EngineConfig) -> bool:
    """Whether the plan counts the fused decode loop (its side lane, its step's terms): the
    loop ``ec.kernels`` resolves to on the engine's device."""
    return V4Backend.of(ec.kernels).resolved(ec.torch_device).decode == "fused"


class DeepseekV4Family(ModelFamily):
    # decode steps are pure device work (step/decode_step.py) once the experts are the fused MXFP4
    # ones (the bf16 loop reads expert counts on the host); set per instance in __init__
    uses_cuda_graphs: ClassVar[bool] = False
    graph_pads_copy_first: ClassVar[bool] = True  # pad rows must not touch slot 0's window ring
    cast_weights_on_load: ClassVar[bool] = False  # FP8/FP4 payloads and scales kept as stored
    supports_tensor_parallel: ClassVar[bool] = True  # dequantized weights (tensor_parallel.py)
    # a verify step's overwritten per-slot state is copied first and put back on a rejection,
    # the kept tokens recomputed by the next chunk (memory/verify_snapshots.py)
    speculation_problem: ClassVar[str | None] = None
    restarts_rejected_verify: ClassVar[bool] = True
    speculative_methods: ClassVar[tuple[str, ...]] = ("ngram", "mtp")
    tensor_parallel_kv: ClassVar[str] = "replicated"  # one shared KV head: whole on every rank
    rerun_safe: ClassVar[bool] = False  # a step advances per-slot window rings and counts

    @staticmethod
    def keeps_stored_dtype(name: str) -> bool:
        return name.endswith((".scale", "_scale_inv", "_proj_scale"))

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], ec: EngineConfig,
                 tp: Any = None) -> None:
        """The kernel choices are the engine config's (``ec.kernels``), the one way to set them.
        ``tp`` (engine/parallel/rank_group.py, or None): ``cfg`` is then a rank's
        (``rank_model_config``) and ``weights`` that rank's slices (``tensor_slicer``)."""
        self.cfg = DeepseekV4Config.from_hf_dict(whole_hf_config(dict(cfg.hf_config)))
        mtp_weights = None
        backend = V4Backend.of(ec.kernels)
        if ec.speculative_method == "mtp":  # before the model takes the weights over
            mtp_weights = mtp_weights_for(self.cfg, weights, ec, tp,
                                       cfg.hf_config.get("num_nextn_predict_layers"))
            # the fused decode loop builds its streams on the device: the drafter needs them
            backend = dataclasses.replace(backend, decode="unfused")
        shard = None
        if tp is not None:
            renumber_experts(weights, tp.rank, tp.size, self.cfg.n_routed_experts)

            def shard(skeleton: torch.nn.Module) -> None:
                cut_model(skeleton, self.cfg, tp.rank, tp.size)
        # the engine hands its weights dict over: experts leave it as they are stacked
        self.model = DeepseekV4Model.from_state_dict(self.cfg, weights, ec.torch_dtype,
                                                     ec.torch_device, backend,
                                                     ec.weight_format,
                                                     consume=True, shard=shard)
        if tp is not None:
            wire_model(self.model, self.cfg, tp.rank, tp)
        self.uses_cuda_graphs = all(isinstance(layer.mlp.experts, Mxfp4Experts)
                                    for layer in self.model.model.layers)
        self.mtp: MtpDrafter | None = None
        if mtp_weights is not None:
            self.model.keep_streams = True
            self.uses_cuda_graphs = False  # each step ends with the MTP pass, host-driven
            self.mtp = MtpDrafter(self.cfg, V4MTPLayer.build(self.cfg, mtp_weights, self.model,
                                                             ec.torch_dtype, ec.torch_device),
                                  ec.max_batch, ec.spec_tokens, ec.block_size, ec.torch_dtype,
                                  ec.torch_device)
        self.snapshots = (VerifySnapshots(self.cfg, ec.max_batch, ec.spec_tokens, ec.torch_dtype,
                                          ec.torch_device) if ec.spec_tokens else None)

    @classmethod
    def dummy_tensors(cls, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                      seed: int) -> Iterator[tuple[str, torch.Tensor]]:
        """In the formats config.json declares: FP8 e4m3 with 128 x 128 block scales for the
        dense projections (``quantization_config.quant_method: fp8``), MXFP4 routed experts
        (``expert_dtype: fp4``), the rest in ``dtype`` (checkpoint_specs.py)."""
        hf = cfg.hf_config
        qc = hf.get("quantization_config")
        if qc and not (isinstance(qc, dict) and qc.get("quant_method") == "fp8"):
            method = qc.get("quant_method") if isinstance(qc, dict) else qc
            raise CheckpointError(f"quantization_config quant_method={method!r}: this family "
                                  "holds FP8 block-scaled projections (quant_method fp8) and "
                                  "MXFP4 experts (expert_dtype fp4) only")
        fp8, fp4 = has_fp8_linears(hf), has_mxfp4_experts(hf)
        if fp8 and isinstance(qc, dict) and list(qc.get("weight_block_size") or [128, 128]) != [128, 128]:
            raise CheckpointError(f"quantization_config weight_block_size="
                                  f"{qc.get('weight_block_size')}: FP8 projections are held "
                                  "with 128 x 128 blocks only")
        v4 = DeepseekV4Config.from_hf_dict(whole_hf_config(dict(hf)))
        return dummy_state_dict(v4, dtype, device, seed, fp8, fp4)

    @classmethod
    def default_block_size(cls, cfg: ModelConfig) -> int:
        return default_block_size(DeepseekV4Config.from_hf_dict(cfg.hf_config))

    @classmethod
    def block_size_problem(cls, cfg: ModelConfig, block_size: int) -> str | None:
        return block_size_problem(DeepseekV4Config.from_hf_dict(cfg.hf_config), block_size)

    @classmethod
    def context_limit(cls, cfg: ModelConfig) -> int:
        return DeepseekV4Config.from_hf_dict(cfg.hf_config).max_position_embeddings

    @classmethod
    def resident_weight_bytes(cls, weights: dict[str, torch.Tensor], ec: EngineConfig) -> int:
        """Quantized payloads as the model will hold them: stored, or dequantized to dtype."""
        return resident_weight_bytes(weights, ec.torch_dtype, ec.weight_format)

    @classmethod
    def rank_model_config(cls, cfg: ModelConfig, size: int) -> ModelConfig:
        """One rank of ``size`` as the operator splits V4 (tensor_parallel.py): the query heads
        with their output-projection groups and the routed experts divided; the single shared
        KV head, the indexer, the shared expert, embedding and head whole on every rank, so the
        KV extent and the indexer's scratch are whole on every rank."""
        hf = rank_hf_config(dict(cfg.hf_config), size, cfg.name)
        return dataclasses.replace(cfg, num_heads=hf["num_attention_heads"], hf_config=hf)

    @classmethod
    def tensor_slicer(cls, cfg: ModelConfig, rank: int, size: int,
                      shapes: Mapping[str, tuple[int, ...]]) -> Any:
        """Each rank reads its query heads, output groups and routed experts only
        (tensor_slices.py), with their FP8 scale rows."""
        rank_hf_config(dict(cfg.hf_config), size, cfg.name)  # refuses a size that does not split
        return v4_tensor_slicer(dict(cfg.hf_config), rank, size, shapes)

    @classmethod
    def kv_layout(cls, cfg: ModelConfig, ec: EngineConfig) -> V4KVLayout:
        from engine.config_resolve import resolve_engine_config

        if not ec.is_resolved:  # sizes left to the model: its defaults
            ec = resolve_engine_config(ec, cfg)
        return V4KVLayout(DeepseekV4Config.from_hf_dict(cfg.hf_config), ec)

    @classmethod
    def plan_terms(cls, cfg: ModelConfig, ec: EngineConfig,
                   weight_bytes: int | None) -> list[PlanTerm]:
        v4 = DeepseekV4Config.from_hf_dict(cfg.hf_config)
        dtype = ec.torch_dtype
        kernels = ec.use_triton_attention
        fp8, fp4 = has_fp8_linears(cfg.hf_config), has_mxfp4_experts(cfg.hf_config)
        if weight_bytes is None:  # no weights read (bulkhead plan): from the config
            weight_bytes = deepseek_v4_weight_bytes(v4, dtype, fp8, fp4, ec.weight_format)
            kept = ec.weight_format == "checkpoint"
            weights_note = (f"from the config: {dtype} tensors"
                            + (", FP8 projections 1 B + fp32 per 128x128" if fp8 and kept else "")
                            + (", MXFP4 experts 0.5 B + 1 B per 32" if fp4 and kept else ""))
        else:
            weights_note = f"as the model holds them (weight_format {ec.weight_format})"
        terms = [
            PlanTerm("weights", weight_bytes, weights_note),
            PlanTerm("slot_carry", slot_carry_bytes(v4, ec.max_batch, ec.torch_dtype),
                     f"max_batch {ec.max_batch} x layers x (window ring {v4.sliding_window} x "
                     f"head_dim {v4.head_dim} + open compressor window: 2 x rate x width) x dtype"),
            PlanTerm("resume_windows", resume_window_bytes(v4, ec.max_batch, dtype, ec.kv_dtype == "fp8"),
                     f"4 x max_batch {ec.max_batch} snapshots x layers {v4.num_layers} x window "
                     f"{v4.sliding_window} x head_dim {v4.head_dim} row "
                     + ("(1 B + fp32 scale)" if ec.kv_dtype == "fp8" else "x dtype")),
        ]
        terms += speculation_terms(v4, ec, dtype)
        scratch = deepseek_v4_step_scratch_bytes(v4, ec.chunk_tokens, ec.max_context,
                                                 ec.max_batch, ec.torch_dtype,
                                                 "kernels" if kernels else "torch")
        # the fused MXFP4 MoE runs wherever the GEMM kernels do (CUDA), whatever attention runs
        mxfp4 = ec.weight_format == "checkpoint" and fp4 and ec.torch_device.type == "cuda"
        # and so do the FP8 linears, whose prefill form quantizes activations into the Workspace
        fp8w = ec.weight_format == "checkpoint" and fp8 and ec.torch_device.type == "cuda"
        if kernels or mxfp4 or fp8w:
            terms.append(PlanTerm("ws.indexer", _align(deepseek_v4_workspace_bytes(
                v4, max(ec.chunk_tokens, ec.max_batch), ec.max_context, mxfp4, dtype, kernels,
                fp8w)),
                "max(tiled indexer top-k scratch + [rows, topk] outputs, fused MXFP4 MoE "
                "scratch: tokens x top_k x (16 + (hidden + intermediate) x dtype) B, FP8 "
                "activation codes + scales: tokens x widest FP8 input x (1 + 4/128) B) "
                "(kernels' size functions)", True))
        if fp8w:
            from kernels.fp8_linear import GEMV_SEMAPHORES

            terms.append(PlanTerm("fp8_gemv_semaphores", 2 * GEMV_SEMAPHORES * 4,
                                  f"2 x {GEMV_SEMAPHORES} int32 counters of the split-K decode "
                                  "GEMVs (kernels.fp8_linear.gemv_semaphores): one set for the "
                                  "main lane, one for the fused decode's side lane"))
        if ec.torch_device.type == "cuda" and _plans_fused_decode(ec):
            # filled in by the planner with the serving stream's measured bytes
            terms.append(PlanTerm(
                SIDE_LANE_LIBRARY_TERM, 0,
                "cuBLAS keeps a workspace per stream: the fused decode's side lane "
                "(step/decode_step.py) runs the compressors' bf16 projections on a stream of its "
                "own, so one more set of library workspaces"))
        terms += [*common_step_terms(cfg, ec), _activations_term(v4, ec, scratch, kernels)]
        if ec.use_cuda_graphs:
            decode = deepseek_v4_step_scratch_bytes(v4, ec.max_batch, ec.max_context, ec.max_batch,
                                                    ec.torch_dtype, "kernels")
            terms.append(PlanTerm(
                "cuda_graph_pool", deepseek_v4_decode_peak_bytes(decode) + GRAPH_POOL_SLACK,
                f"activations of a {ec.max_batch}-sequence decode step (projections, batched decode "
                f"attention, MoE at {ec.max_batch} tokens) + 44 MiB allocator segment granularity "
                "(two streams)"))
        return terms

    def forward(self, batch: StepBatch, kv: Any, ws: Workspace | None) -> torch.Tensor:
        """Binds each sequence to its slot (fresh, resumed from its blocks, or continued) and
        runs the model over the step. Returns hidden [N, hidden]."""
        pool: DeepseekV4KVPool = kv
        if batch.cache_slots_t is not None:  # a CUDA-graph decode step: device work only
            assert batch.block_tables_t is not None
            rows = DecodeRows(batch.cache_slots_t, batch.positions, batch.block_tables_t.long())
            return self.model.forward_decode(batch.input_ids, rows, pool, ws)
        firsts = batch.first_chunks or [False] * batch.num_seqs
        drafts = batch.num_draft_tokens or [0] * batch.num_seqs
        mtp_rows = []
        for i, slot in enumerate(batch.cache_slots):
            start = batch.context_lens[i] - batch.query_len(i)
            rolled = bind_slot(pool, slot, start, firsts[i], batch.block_tables[i], self.snapshots)
            if self.mtp is not None:
                mtp_rows.append(MtpRow(slot, start, firsts[i], drafts[i] > 0,
                                       list(batch.block_tables[i])))
                self.mtp.bind(mtp_rows[-1], rolled)
        if self.snapshots is not None and batch.num_draft_tokens:
            for i, slot in enumerate(batch.cache_slots):
                if batch.num_draft_tokens[i]:
                    self.snapshots.take(pool, slot, batch.context_lens[i] - batch.query_len(i),
                                        batch.query_len(i), batch.block_tables[i])
        # after every restore (a restore touches its snapshot, so it is not the one reused)
        for i, slot in enumerate(batch.cache_slots):
            pool.plan_windows(slot, batch.block_tables[i], batch.context_lens[i] - batch.query_len(i),
                              batch.query_len(i))
        hidden = self.model(batch.input_ids, batch.positions, batch.query_start_loc,
                            batch.cache_slots, pool, ws, batch.block_tables, batch.block_tables_t)
        if self.mtp is not None:
            assert self.model.last_streams is not None
            self.mtp.absorb(mtp_rows, batch.input_ids, batch.query_start_loc,
                            self.model.last_streams, ws)
        return hidden

    def propose_drafts(self, kv: DeepseekV4KVPool,
                       requests: list[tuple[int, int, int, int, list[int]]]) -> list[list[int]]:
        """MTP drafts (step/mtp_drafter.py) for running decodes: (slot, last token, its position,
        drafts wanted, block table) each."""
        assert self.mtp is not None, "speculative_method is not mtp"
        return self.mtp.propose(requests, None)

    def before_graph_step(self, kv: DeepseekV4KVPool, chunks: list[Any]) -> None:
        """The bookkeeping of :meth:`forward` and of the model's step for a graph replay: bind
        each slot, check its room, count the token it absorbs."""
        for c in chunks:
            bind_slot(kv, c.cache_slot, c.start, c.is_first, c.block_ids, self.snapshots)
            kv.check_room(c.cache_slot, c.num_tokens, torch.as_tensor(c.block_ids))
        for c in chunks:  # after every restore, as in forward
            kv.plan_windows(c.cache_slot, list(c.block_ids), c.start, c.num_tokens)
            kv.num_tokens[c.cache_slot] = c.start + c.num_tokens

    def after_graph_step(self, kv: DeepseekV4KVPool, chunks: list[Any]) -> None:
        """The replay wrote the rings only: take this step's planned window snapshots."""
        for c in chunks:
            kv.snapshot_from_rings(c.cache_slot)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden, out)

    @classmethod
    def step_context_limit(cls, ec: EngineConfig) -> int:
        """A step's chunks gather their compressed entries (and indexer keys) into one table:
        the plan counts it for the pool's tokens (``_activations_term``), and the scheduler
        keeps the chunks' contexts within that, which the pool alone does not do once
        prefix-cached sequences share blocks."""
        return (ec.resolved_num_blocks - 1) * ec.block_size

    def warmup_steps(self, ec: EngineConfig, table: tuple[int, ...]) -> list[list[Any]]:
        """The base worst steps, with the mixed step's chunks ending where their contexts
        together reach :meth:`step_context_limit` at most (what the scheduler lets through; the
        base step puts every chunk at the longest context), and a mixed step of decodes."""
        steps = super().warmup_steps(ec, table)
        limit = self.step_context_limit(ec)
        mixed = steps[-1]
        if sum(c.context_len for c in mixed if c.num_tokens > 1) > limit:
            share = limit // max(1, len(mixed))
            steps[-1] = [dataclasses.replace(c, start=min(c.start, max(0, share - c.num_tokens)))
                         if c.num_tokens > 1 else c for c in mixed]
        # a mixed step's one-token rows take the unfused decode path after the chunks attend
        # (its gathered windows, the PyTorch indexer tile): a full batch of them at the longest
        # context beside one chunk with the rest of the budget, which the plan's attention
        # term counts ("decode") and the steps above never run
        rest = ec.chunk_tokens - (ec.max_batch - 1)
        end = ec.max_context - 1
        if ec.max_batch > 1 and rest >= 2:
            m = min(rest, end)
            from engine.scheduler import ScheduledChunk

            steps.append([ScheduledChunk(f"warmup-mixdec-{i}", end, 1, (0,), table, i, True)
                          for i in range(ec.max_batch - 1)]
                         + [ScheduledChunk("warmup-mixdec-chunk", end - m, m, (0,) * m, table,
                                           ec.max_batch - 1, True)])
        return steps

    def prepare_warmup(self, kv: DeepseekV4KVPool, chunks: list[Any]) -> None:
        for c in chunks:
            kv.pretend_filled(c.cache_slot, c.start)

    def reset(self, kv: DeepseekV4KVPool) -> None:
        if self.mtp is not None:
            self.mtp.warm_up()
        if self.snapshots is not None:  # the warm-up's verify step: put its copies back too
            for slot, p in enumerate(self.snapshots.pending):
                if p is not None:
                    self.snapshots.rollback(kv, slot, p.start)
        for slot in range(kv.max_batch):
            kv.reset_slot(slot)
        kv.reset_windows()
