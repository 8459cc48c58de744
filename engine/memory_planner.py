"""The memory plan: every byte the engine will hold, decided before the first request.

``make_plan`` computes each term from (model config, dtype, longest chunk, longest context,
largest batch); start-up refuses a plan that does not fit, naming the numbers and what to change.
docs/memory.md gives the formula of each term; keep the two in step. The plan's vocabulary
(``PlanTerm``, ``MemoryPlan``) is the leaf engine/memory_plan.py, which the families use too.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from engine.config import EngineConfig
from engine.config_resolve import resolve_engine_config
from engine.kv_layout import KVLayout
from engine.memory_plan import MemoryPlan, MiB, PlanTerm
from engine.model_config import ModelConfig
from engine.models.family import family_class
from engine.parallel.comm_terms import comm_terms
from engine.prompt_logprobs import prompt_logprob_rows, prompt_logprobs_workspace_bytes
from engine.sampler import sampler_workspace_bytes
from engine.slot_sampling import slot_sampling_bytes
from engine.spec_decode import spec_decode_workspace_bytes
from engine.workspace import _align

GRAPH_POOL_SLACK = 42 * MiB
# a family's term for the library workspaces of a second stream it runs library GEMMs on
# (engine/side_lane.py): listed with 0 bytes by the family, sized here as the serving stream's
SIDE_LANE_LIBRARY_TERM = "side_lane_library_workspaces"
ALLOCATOR_SLACK = 8 * MiB  # small-pool headroom reserved after warm-up (4 segments)


def step_inputs_term(ec: EngineConfig) -> PlanTerm:
    """Step inputs staged in the workspace: token ids, positions, KV slots (int64 per token),
    logits rows (int64 per sequence) and, for the kernels, block tables, query offsets and
    context lengths (int32)."""
    tokens = ec.chunk_tokens
    seqs = min(ec.max_batch, ec.chunk_tokens)
    rows = min(ec.verify_rows, tokens)  # logits rows: one a sequence, or a verify step's
    nbytes = (3 * _align(tokens * 8) + _align(rows * 8) + _align(seqs * ec.blocks_per_seq * 4)
              + _align((seqs + 1) * 4) + _align(seqs * 4))
    return PlanTerm("ws.step_inputs", nbytes,
                    f"3 x chunk {tokens} x 8 B + logits rows {rows} x 8 B + min(batch, chunk) "
                    f"{seqs} x (blocks_per_seq {ec.blocks_per_seq} x 4 + 8) B", True)


def sampler_term(model: ModelConfig, ec: EngineConfig) -> PlanTerm:
    """The sampler's scratch for a full batch: processors (penalty counts and masks, bias and
    stop lists), logprobs with the top alternatives, and one row's sort buffers at a time."""
    rows = ec.verify_rows
    return PlanTerm("ws.sampler", _align(sampler_workspace_bytes(model.vocab_size, rows)),
                    f"rows {rows} (max_batch {ec.max_batch} x (spec tokens {ec.spec_tokens} + 1))"
                    f" x vocab {model.vocab_size} x (4 + 4 + 1 + 1 + 4) B"
                    " + vocab x (4 + 8 + 4 + 1) B + bias/stop/top-logprob lists", True)


def spec_decode_term(model: ModelConfig, ec: EngineConfig) -> PlanTerm:
    """A verify step's own scratch (engine/spec_decode.py): the penalties' draft count pairs,
    the target distribution in token order and the kept tokens; 0 without speculation."""
    k = ec.spec_tokens
    return PlanTerm("ws.spec_decode",
                    _align(spec_decode_workspace_bytes(model.vocab_size, ec.max_batch, k)),
                    f"max_batch {ec.max_batch} x k(k+1)/2 (k = {k}) draft pairs x 20 B + vocab "
                    f"{model.vocab_size} x 4 B + max_batch x (k + 1) x 28 B (0 when k = 0)", True)


def prompt_logprobs_term(model: ModelConfig, ec: EngineConfig) -> PlanTerm:
    """Prompt scoring (engine/prompt_logprobs.py): one decode batch of logits rows reused over
    the chunk, and the chunk's chosen and top-5 logprobs."""
    rows = prompt_logprob_rows(ec.chunk_tokens, ec.max_batch)
    return PlanTerm("ws.prompt_logprobs",
                    prompt_logprobs_workspace_bytes(model.vocab_size, ec.chunk_tokens,
                                                    ec.max_batch),
                    f"min(chunk, max_batch) {rows} x (vocab {model.vocab_size} + 1) x 4 B + "
                    f"chunk {ec.chunk_tokens} x (8 + 4 + 5 x 4 + 5 x 8) B", True)


def slot_sampling_term(model: ModelConfig, ec: EngineConfig) -> PlanTerm:
    """Per-slot sampling state: token counts and prompt masks for penalties, logit bias and
    min_tokens stop ids (engine/slot_sampling.py)."""
    return PlanTerm("slot_sampling", slot_sampling_bytes(ec.max_batch, model.vocab_size),
                    f"max_batch {ec.max_batch} x (vocab {model.vocab_size} x (4 + 1) B + 300 "
                    "bias x 12 B + 64 stop ids x 8 B + 20 B)")


def common_step_terms(model: ModelConfig, ec: EngineConfig) -> list[PlanTerm]:
    """What every family takes for a step: the logits rows, the sampler's scratch, the per-slot
    sampling state and the staged step inputs."""
    rows = ec.verify_rows
    return [
        PlanTerm("ws.logits", _align(rows * model.vocab_size * 4),
                 f"rows {rows} (max_batch {ec.max_batch} x (spec tokens {ec.spec_tokens} + 1), "
                 f"at most the chunk) x vocab {model.vocab_size} x 4 B", True),
        sampler_term(model, ec),
        spec_decode_term(model, ec),
        prompt_logprobs_term(model, ec),
        slot_sampling_term(model, ec),
        step_inputs_term(ec),
    ]


def make_plan(model: ModelConfig, ec: EngineConfig, device_memory_bytes: int,
              weight_bytes: int | None = None, non_torch_bytes: int = 0,
              library_bytes: int = 0, device_label: str | None = None,
              mapped_weight_bytes: int = 0) -> MemoryPlan:
    """The family gives the block geometry and its own terms; the KV extent is the engine's
    number of blocks times the layout's bytes per block. ``mapped_weight_bytes``: the weights
    live in another process's memory (one-box mode): this plan's ``weights`` term is 0 and a
    ``weights_mapped`` term lists them outside the total."""
    if not ec.is_resolved:  # sizes left to the model: its defaults (auto context as on a CPU)
        ec = resolve_engine_config(ec, model)
    family = family_class(model)
    layout = family.kv_layout(model, ec)
    num_blocks = ec.resolved_num_blocks
    kinds = " + ".join(f"{k.name} {k.layers} x {k.rows} x {k.row_bytes} B" for k in layout.kinds)
    terms = family.plan_terms(model, ec, weight_bytes)
    if ec.tensor_parallel_size > 1:  # ``model`` is then one rank's share (engine/parallel/)
        terms.extend(comm_terms(model, ec, nccl_measured=non_torch_bytes > 0))
    if mapped_weight_bytes:
        terms.insert(1, PlanTerm("weights_mapped", mapped_weight_bytes,
                                 "one arena of weights exported by another process on this "
                                 "device (CUDA IPC), mapped here", mapped=True))
    terms.insert(1, PlanTerm(
        "kv_cache", num_blocks * layout.bytes_per_block,
        f"num_blocks {num_blocks} x {layout.bytes_per_block:,} B per block of "
        f"{layout.block_size} tokens ({kinds})"))
    if ec.tensor_parallel_size == 1:  # several ranks: each moves its own share (kv_gather)
        terms.insert(2, kv_import_slice_term(ec, layout))
    return _finish_plan(terms, ec, layout, num_blocks, device_memory_bytes, library_bytes,
                        non_torch_bytes, device_label)


def kv_import_slice_term(ec: EngineConfig, layout: KVLayout) -> PlanTerm:
    """The device buffer imported KV passes through, one step's slice at a time
    (engine/kv_import_job.py): whole blocks, at least one, at most one sequence's."""
    blocks = min(max(1, ec.kv_import_slice_bytes // layout.bytes_per_block), ec.blocks_per_seq)
    return PlanTerm("kv_import_slice", blocks * layout.bytes_per_block,
                    f"min(max(1, kv_import_slice_bytes {ec.kv_import_slice_bytes:,} // "
                    f"{layout.bytes_per_block:,} B per block), blocks_per_seq "
                    f"{ec.blocks_per_seq}) = {blocks} blocks")


def _finish_plan(terms: list[PlanTerm], ec: EngineConfig, kv_layout: KVLayout, num_blocks: int,
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
        # cuBLAS keeps a workspace per (handle, stream): the graphs are captured on a stream of
        # their own, so its workspaces are allocated during the first capture, inside the pool
        terms = [replace(t, bytes=t.bytes + library_bytes,
                         formula=f"{t.formula} + the capture stream's cuBLAS workspaces "
                                 f"({library_bytes:,} B, as measured for the serving stream)")
                 if t.name == "cuda_graph_pool" else
                 replace(t, bytes=library_bytes,
                         formula=f"{t.formula} ({library_bytes:,} B, as measured for the "
                                 "serving stream)")
                 if t.name == SIDE_LANE_LIBRARY_TERM else t for t in terms]
    if non_torch_bytes:
        terms.append(PlanTerm("non_torch", non_torch_bytes,
                              "CUDA context and libraries, measured before loading"))
    return MemoryPlan(tuple(terms), device_label or str(ec.torch_device), device_memory_bytes,
                      kv_layout, num_blocks, ec)


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
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def resolve_config_before_load(ec: EngineConfig, model: ModelConfig) -> EngineConfig:
    """``resolve_engine_config`` before any weight is read, for the processes that must agree
    on the sizes before they load (tensor-parallel ranks): the weights' bytes are the family's
    estimate from the config (as ``bulkhead plan`` has them)."""
    rank = model
    if ec.tensor_parallel_size > 1:
        rank = family_class(model).rank_model_config(model, ec.tensor_parallel_size)
    memory = device_memory(ec)
    return resolve_engine_config(ec, model, lambda c: make_plan(rank, c, memory).fits)


def plan_engine(model: ModelConfig, rank_model: ModelConfig, ec: EngineConfig, weight_bytes: int,
                non_torch_bytes: int = 0,
                mapped_weight_bytes: int = 0) -> tuple[EngineConfig, MemoryPlan]:
    """The plan a serving engine starts on (not yet checked), with ``ec``'s sizes left to the
    model resolved against this device's budget first (the longest context that fits).
    ``rank_model``: the model as this rank holds it (``model`` with one rank)."""
    memory, library = device_memory(ec), library_workspaces(ec)

    def plan_for(c: EngineConfig) -> MemoryPlan:
        return make_plan(rank_model, c, memory, weight_bytes, non_torch_bytes, library,
                         mapped_weight_bytes=mapped_weight_bytes)

    if not ec.is_resolved:  # sizes left to the model (engine/config_resolve.py)
        ec = resolve_engine_config(ec, model, lambda c: plan_for(c).fits)
    return ec, plan_for(ec)
