"""The memory plan: every byte the engine will hold, decided before the first request.

``make_plan`` computes each term from (model config, dtype, longest chunk, longest context,
largest batch); start-up refuses a plan that does not fit, naming the numbers and what to change.
docs/memory.md gives the formula of each term; keep the two in step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine.config import EngineConfig
from engine.errors import PlanError
from engine.model_config import ModelConfig
from engine.models.family import KVLayout
from engine.prompt_logprobs import prompt_logprob_rows, prompt_logprobs_workspace_bytes
from engine.sampler import sampler_workspace_bytes
from engine.slot_sampling import slot_sampling_bytes
from engine.spec_decode import spec_decode_workspace_bytes
from engine.workspace import _align

GiB = 1 << 30
MiB = 1 << 20
GRAPH_POOL_SLACK = 42 * MiB
# a family's term for the library workspaces of a second stream it runs library GEMMs on
# (engine/side_lane.py): listed with 0 bytes by the family, sized here as the serving stream's
SIDE_LANE_LIBRARY_TERM = "side_lane_library_workspaces"
ALLOCATOR_SLACK = 8 * MiB  # small-pool headroom reserved after warm-up (4 segments)


@dataclass(frozen=True)
class PlanTerm:
    name: str
    bytes: int
    formula: str
    in_workspace: bool = False  # a slice of the workspace arena, not a separate allocation
    # memory another process owns and this one maps (shared weights): listed, not in the total
    mapped: bool = False


@dataclass(frozen=True)
class MemoryPlan:
    terms: tuple[PlanTerm, ...]
    device: str
    device_memory_bytes: int
    kv_layout: KVLayout
    num_blocks: int
    # the resolved configuration planned: its limits (max_context, max_batch, chunk_tokens) and
    # budget (memory_utilization, memory_share) are read from it, not copied into the plan
    config: EngineConfig

    @property
    def kv_tokens(self) -> int:
        """Tokens the KV extent holds, all sequences together (the null block excluded)."""
        return (self.num_blocks - 1) * self.kv_layout.block_size

    @property
    def kv_tokens_per_gib(self) -> float:
        return GiB / self.kv_layout.bytes_per_token

    def term(self, name: str) -> int:
        return sum(t.bytes for t in self.terms if t.name == name)

    @property
    def workspace_bytes(self) -> int:
        return sum(t.bytes for t in self.terms if t.in_workspace)

    @property
    def total_bytes(self) -> int:
        """What this process owns on the device (mapped terms excluded)."""
        return sum(t.bytes for t in self.terms if not t.mapped)

    @property
    def mapped_bytes(self) -> int:
        return sum(t.bytes for t in self.terms if t.mapped)

    @property
    def budget_bytes(self) -> int:
        """``memory_utilization`` of the device; with a ``memory_share`` below 1 (the roles of
        one card), that share of what the one copy of the weights leaves, plus the weights
        when this process owns them."""
        whole = int(self.device_memory_bytes * self.config.memory_utilization)
        if self.config.memory_share >= 1:
            return whole
        owned = self.term("weights")
        return int(self.config.memory_share * max(0, whole - owned - self.mapped_bytes)) + owned

    @property
    def headroom_bytes(self) -> int:
        return self.budget_bytes - self.total_bytes

    @property
    def fits(self) -> bool:
        return self.headroom_bytes >= 0

    def check(self) -> None:
        if self.fits:
            return
        c = self.config
        weights = self.term("weights")
        if weights >= self.budget_bytes:
            raise PlanError(
                f"memory plan does not fit: the weights alone are {weights / GiB:.2f} GiB, the "
                f"budget {self.budget_bytes / GiB:.2f} GiB ({c.memory_utilization:.0%} of "
                f"{self.device_memory_bytes / GiB:.2f} GiB on {self.device}): split the model "
                "over more devices (tensor_parallel_size) or use a quantized checkpoint")
        kv = self.term("kv_cache")
        raise PlanError(
            f"memory plan does not fit: needs {self.total_bytes / GiB:.2f} GiB, budget is "
            f"{self.budget_bytes / GiB:.2f} GiB ({c.memory_utilization:.0%} of "
            f"{self.device_memory_bytes / GiB:.2f} GiB on {self.device}"
            + (f", {c.memory_share:g} of what the weights leave" if c.memory_share < 1 else "")
            + "). Largest terms: "
            + ", ".join(f"{t.name}={t.bytes / GiB:.2f} GiB"
                        for t in sorted(self.terms, key=lambda t: -t.bytes)[:3])
            + f". Lower max_context ({c.max_context}), max_batch ({c.max_batch}) or "
            f"num_blocks (KV is {kv / GiB:.2f} GiB), lower chunk_tokens ({c.chunk_tokens}), "
            "or use a smaller dtype.")

    def to_json(self) -> dict:
        return {
            "device": self.device,
            "device_memory_bytes": self.device_memory_bytes,
            "memory_utilization": self.config.memory_utilization,
            "memory_share": self.config.memory_share,
            "budget_bytes": self.budget_bytes,
            "total_bytes": self.total_bytes,
            "headroom_bytes": self.headroom_bytes,
            "mapped_bytes": self.mapped_bytes,
            "max_context": self.config.max_context,
            "chunk_tokens": self.config.chunk_tokens,
            "max_batch": self.config.max_batch,
            "num_blocks": self.num_blocks,
            "block_size": self.kv_layout.block_size,
            "kv_bytes_per_block": self.kv_layout.bytes_per_block,
            "kv_bytes_per_token": self.kv_layout.bytes_per_token,
            "kv_tokens": self.kv_tokens,
            "kv_tokens_per_gib": self.kv_tokens_per_gib,
            "kv_layout_fingerprint": self.kv_layout.fingerprint,
            "terms": [{"name": t.name, "bytes": t.bytes, "formula": t.formula,
                       "in_workspace": t.in_workspace, "mapped": t.mapped}
                      for t in self.terms],
        }

    def table(self) -> str:
        rows = [f"{'term':<22}{'bytes':>16}{'GiB':>10}  formula"]
        for t in self.terms:
            note = "  [mapped: another process owns it; not in the total]" if t.mapped else ""
            rows.append(f"{t.name:<22}{t.bytes:>16,}{t.bytes / GiB:>10.3f}  {t.formula}{note}")
        rows.append(f"{'total':<22}{self.total_bytes:>16,}{self.total_bytes / GiB:>10.3f}")
        c = self.config
        share = f", {c.memory_share:g} of what the weights leave" if c.memory_share < 1 else ""
        rows.append(f"{'budget':<22}{self.budget_bytes:>16,}{self.budget_bytes / GiB:>10.3f}  "
                    f"{c.memory_utilization} x {self.device_memory_bytes:,} ({self.device})"
                    + share)
        rows.append(f"{'kv tokens':<22}{self.kv_tokens:>16,}  in {self.num_blocks - 1:,} blocks of "
                    f"{self.kv_layout.block_size} ({self.kv_layout.bytes_per_token:,.1f} B a token, "
                    f"{self.kv_tokens_per_gib:,.0f} tokens per GiB)")
        rows.append(f"{'headroom':<22}{self.headroom_bytes:>16,}{self.headroom_bytes / GiB:>10.3f}")
        return "\n".join(rows)


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
    from engine.config_resolve import resolve_engine_config
    from engine.models import family_class

    if not ec.is_resolved:  # sizes left to the model: its defaults (auto context as on a CPU)
        ec = resolve_engine_config(ec, model)
    family = family_class(model)
    layout = family.kv_layout(model, ec)
    num_blocks = ec.resolved_num_blocks
    kinds = " + ".join(f"{k.name} {k.layers} x {k.rows} x {k.row_bytes} B" for k in layout.kinds)
    terms = family.plan_terms(model, ec, weight_bytes)
    if ec.tensor_parallel_size > 1:  # ``model`` is then one rank's share (engine/parallel/)
        from engine.parallel.rank_runner import comm_terms

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
    import os
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
