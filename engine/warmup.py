"""The start-up warm-up of a ModelRunner: the plan's worst-case steps run once, so the plan's
arithmetic becomes a measured peak, then the decode graphs are captured and the allocation
baseline taken; after it the workspace is locked and a step that makes the CUDA allocator grow
is reported (``ModelRunner.check_device_allocations``).

Drives the runner it is given (its model, KV, workspace, sampling state) the way serving does;
never runs after start-up except ``recapture_graphs`` (a benchmark's A/B on the same weights).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.block_manager import NULL_BLOCK
from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs
from engine.errors import PlanError
from engine.memory_planner import reserve_allocator_slack
from engine.model_runner import ModelRunner
from engine.prompt_logprobs import prompt_logprob_rows, score_prompt_spans
from engine.sampler import RowState, sample
from engine.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_PROMPT_LOGPROBS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from engine.scheduler import ScheduledChunk
from engine.spec_decode import verify
from engine.warmup_record import WarmupRecord

log = logging.getLogger(__name__)


@dataclass
class WarmupReport:
    workspace_peak_bytes: int
    workspace_capacity_bytes: int
    activation_peak_bytes: int | None  # CUDA only: measured transient peak of the worst step
    activation_planned_bytes: int
    device_allocs_after_warmup: int | None  # CUDA only


def verify_warmup_step(ec: EngineConfig, table: tuple[int, ...]) -> list[ScheduledChunk]:
    """The largest verify step of the plan: ``verify_rows`` logits rows spread over a full
    batch (each sequence its last token and up to ``spec_tokens`` drafts) at the longest
    context."""
    total, k = ec.verify_rows, ec.spec_tokens
    seqs = min(ec.max_batch, total)
    end = ec.max_context - 1
    chunks = []
    for i in range(seqs):
        n = min(k + 1, total // seqs + (i < total % seqs), end)
        chunks.append(ScheduledChunk(f"warmup-verify-{i}", end - n + 1, n, (0,) * n, table, i,
                                     True, num_draft_tokens=n - 1))
    return chunks


class Warmup:
    """The warm-up of one ``runner``: ``run`` at start-up (``LLMEngine``), ``capture_graphs``
    also on the other tensor-parallel ranks when rank 0 says so (engine/parallel/follower.py)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def run(self, progress: Callable[[str], None] | None = None,
            passed: WarmupReport | None = None) -> WarmupReport:
        """Run the family's worst-case steps of the plan (the longest chunk against the longest
        context, a full batch of decodes at the longest context, ...); KV writes of the dense
        families go to the null block, others' to blocks no sequence holds yet. ``progress``
        (optional) is told each step before it runs. ``passed`` (CPU only): the report of
        these very steps having passed before (engine/warmup_record.py); they are skipped."""
        runner = self.runner
        cuda = runner.device.type == "cuda"
        if passed is not None:
            assert not cuda and runner.tp is None, "a warm-up is skipped on one CPU rank only"
            if progress is not None:
                progress("warm-up skipped: passed before with this model, config and code")
            runner.ws.lock()
            runner.model.reset(runner.kv)
            runner.num_steps = 0
            return passed
        if cuda:
            # Garbage from loading (a reference cycle that still holds device tensors) must go
            # before the baseline: collected mid-warm-up, its bytes would be reused by the
            # steps' transients and the peak above the baseline would read low.
            gc.collect()
            torch.cuda.synchronize(runner.device)
            base = torch.cuda.memory_allocated(runner.device)
            torch.cuda.reset_peak_memory_stats(runner.device)
        steps, names = self.steps()
        self.run_steps(steps, progress, names)
        self.warm_import()
        act_peak = None
        if cuda:
            torch.cuda.synchronize(runner.device)
            act_peak = torch.cuda.max_memory_allocated(runner.device) - base
        runner.ws.lock()
        runner.tell("lock")
        if runner.use_graphs:
            if progress is not None:
                progress("capturing CUDA graphs")
            self.capture_graphs()
        if cuda:
            self.settle(steps, names, progress)
        runner.model.reset(runner.kv)
        runner.tell("reset")
        runner.num_steps = 0
        return WarmupReport(runner.ws.peak_bytes, runner.ws.capacity, act_peak,
                            runner.plan.term("activations"), runner.device_alloc_baseline)

    def steps(self) -> tuple[list, list[str]]:
        """The family's worst-case steps of the plan, and a name for each."""
        runner = self.runner
        usable = runner.plan.num_blocks - 1
        table = tuple(1 + (i % usable) for i in range(runner.ec.blocks_per_seq))
        steps = runner.model.warmup_steps(runner.ec, table)
        names = [f"{len(c)} sequence(s), {sum(x.num_tokens for x in c)} tokens up to context "
                 f"{max(x.context_len for x in c)}" for c in steps]
        if runner.ec.spec_tokens:
            steps.append(verify_warmup_step(runner.ec, table))
            names.append(f"verify {len(steps[-1])} sequence(s), "
                         f"{sum(c.num_logits_rows for c in steps[-1])} logits rows "
                         f"(up to {runner.ec.spec_tokens} drafts each)")
        return steps, names

    def settle(self, steps: list, names: list[str],
               progress: Callable[[str], None] | None) -> None:
        """After a capture (CUDA): torch.cuda.graph() empties the allocator's cache before it
        captures, so run the worst steps again for the cache to hold what serving needs, leave
        the planned slack, then take the allocation baseline."""
        runner = self.runner
        self.run_steps(steps, progress, names)
        self.warm_import()
        reserve_allocator_slack(runner.device, runner.plan.term("allocator_slack"))
        torch.cuda.synchronize(runner.device)
        allocs = torch.cuda.memory_stats(runner.device).get("num_device_alloc", 0)
        runner.device_alloc_baseline = runner.allocs_after_warmup = allocs

    def recapture_graphs(self, progress: Callable[[str], None] | None = None) -> None:
        """Capture the decode graphs again after a change to how the model runs its step (a
        benchmark comparing one model option on the same weights, without building them
        twice): the old graphs and their pool go first, then the warm-up's capture, re-run and
        allocation baseline (``device_allocs_since_warmup`` counts from here on). The caller
        (``LLMEngine.recapture_graphs``) makes sure that no block is in use: the re-run writes
        into blocks as the warm-up does. One rank only."""
        runner = self.runner
        if runner.graphs is None:
            return
        if runner.tp is not None:
            raise PlanError("recapture_graphs: not with several ranks (they capture in step)")
        runner.graphs = None
        gc.collect()
        torch.cuda.synchronize(runner.device)
        torch.cuda.empty_cache()  # the old graphs' pool back to the device before the new one
        self.capture_graphs()
        steps, names = self.steps()
        self.settle(steps, names, progress)
        runner.model.reset(runner.kv)

    @torch.inference_mode()
    def warm_import(self) -> None:
        """A full slice of the KV import path (engine/kv_import_job.py) into the null block with
        its own bytes, so nothing changes: the kernels load and the allocator caches what a
        serving slice takes, before the allocation baseline."""
        runner = self.runner
        buf, layout = runner.import_buffer, runner.plan.kv_layout
        if buf is None:
            return
        row = layout.export_blocks(runner.kv, [NULL_BLOCK]).cpu()
        buf.copy_(row.expand(buf.shape[0], -1), non_blocking=True)
        layout.import_blocks(runner.kv, [NULL_BLOCK] * buf.shape[0], buf)

    def run_steps(self, steps: list[list[ScheduledChunk]],
                          progress: Callable[[str], None] | None = None,
                          names: Sequence[str] = ()) -> None:
        runner = self.runner
        vocab = runner.model_cfg.vocab_size
        # Every sampler stage at its largest: full logit bias and stop lists, penalties, min_p,
        # min_tokens holding, the most logprobs; greedy rows with processors too.
        extra = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
                     logit_bias=tuple((t % vocab, 1.0) for t in range(MAX_LOGIT_BIAS)),
                     stop_token_ids=tuple(t % vocab for t in range(MAX_STOP_TOKEN_IDS)),
                     min_tokens=1, logprobs=MAX_LOGPROBS, max_tokens=2)
        # greedy rows also score their prompt rows (the largest chunk scores all of its rows)
        greedy = SamplingParams(temperature=0.0, prompt_logprobs=MAX_PROMPT_LOGPROBS, **extra)
        random = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.05, seed=0, **extra)
        prompt = (0,) * min(runner.ec.chunk_tokens, runner.ec.max_context - 1)
        for k, chunks in enumerate(steps):
            if progress is not None:
                progress(f"warm-up {k + 1}/{len(steps)}: {names[k] if k < len(names) else ''}")
            runner.model.prepare_warmup(runner.kv, chunks)
            runner.tell("prepare_warmup", chunks)
            params = {c.request_id: (random if i % 2 else greedy) for i, c in enumerate(chunks)}
            rows = {}
            with torch.inference_mode():
                for c in chunks:
                    sp = params[c.request_id]
                    runner.slot_sampling.admit(c.cache_slot, sp, prompt, (1,), sp.stop_token_ids,
                                             runner.ws)
                    rows[c.request_id] = RowState(c.cache_slot, 0)
            gens = {c.request_id: runner.generators[c.cache_slot].manual_seed(0) for c in chunks}
            self.execute_step(chunks, params, gens, rows)

    def capture_graphs(self) -> None:
        """Capture the decode graphs; on rank 0 of several, the other ranks capture the same
        sizes in the same order at the same time (their all-reduces pair up)."""
        runner = self.runner
        ec = runner.ec
        runner.tell("capture")
        runner.graphs = DecodeGraphs(runner.forward_logits, runner.ws, runner.model_cfg.vocab_size,
                                   ec.max_batch, ec.blocks_per_seq, ec.block_size, runner.device,
                                   pad_with_first=runner.model.graph_pads_copy_first,
                                   capture_error_mode="global" if runner.tp is None
                                   else "thread_local")
        with torch.inference_mode():
            runner.graphs.capture()
        planned = runner.plan.term("cuda_graph_pool")
        if runner.graphs.pool_bytes > planned:
            raise PlanError(f"CUDA graph capture took {runner.graphs.pool_bytes:,} B, the plan "
                            f"counted {planned:,} B for its pool; refusing to serve on a wrong plan")
        if runner.tp is not None:
            outside = runner.plan.term("tp.graph_collectives")
            if runner.graphs.outside_bytes > outside:
                log.warning("CUDA graph capture took %d B of device memory outside PyTorch "
                            "(NCCL's captured collectives, module loads); the plan counted %d B",
                            runner.graphs.outside_bytes, outside)

    def execute_step(self, chunks: list[ScheduledChunk], params: dict[str, SamplingParams],
                        gens: dict[str, torch.Generator], rows: dict[str, RowState]) -> None:
        runner = self.runner
        sampled_ids = [c.request_id for c in chunks]
        runner.tell("forward", chunks, True)
        with torch.inference_mode(), runner.ws.scope():
            batch = runner.build_batch(chunks)
            batch.slot_mapping.fill_(NULL_BLOCK)  # warm-up writes land in the null block only
            hidden = runner.model.forward(batch, runner.kv, runner.ws)
            num_rows = sum(c.num_logits_rows for c in chunks)
            logits = runner.ws.take((num_rows, runner.model_cfg.vocab_size), torch.float32,
                                  caller="model_runner.logits")
            runner.model.compute_logits(hidden.index_select(0, batch.logits_indices), logits)
            if num_rows > len(chunks):  # the verify step: drafts of token 0 after token 0
                verify(logits, [params[r] for r in sampled_ids],
                       [c.draft_token_ids for c in chunks], [gens[r] for r in sampled_ids],
                       runner.ws, [rows[r] for r in sampled_ids], runner.slot_sampling,
                       runner.bitmask, [None] * len(sampled_ids))
                return
            # every row of a chunk scored as a prompt row (targets: token 0, valid for any vocab)
            spans = runner.prompt_spans(chunks, params, {
                c.request_id: (0,) * (c.start + c.num_tokens + 1) for c in chunks})
            if spans:
                score_prompt_spans(hidden, spans, prompt_logprob_rows(runner.ec.chunk_tokens,
                                                                      runner.ec.max_batch),
                                   runner.model_cfg.vocab_size, runner.model.compute_logits, runner.ws)
            sample(logits, [params[r] for r in sampled_ids], [gens[r] for r in sampled_ids],
                   runner.ws, [rows[r] for r in sampled_ids], runner.slot_sampling, runner.bitmask,
                   [None] * len(sampled_ids))  # an all-ones mask: the copy and the kernel run


def warm_up(runner: ModelRunner, ec: EngineConfig, model_fingerprint: str, one_rank: bool,
            progress: Callable[[str], None] | None = None) -> WarmupReport:
    """The engine's start-up warm-up: skipped on one CPU rank when ``ec.warmup_record_dir``
    records that these very steps passed before (engine/warmup_record.py), else run (and
    recorded there). A measured activation peak above the plan's is a PlanError: the plan is
    wrong for this model and device, so serving on it would not be safe."""
    record = (WarmupRecord.for_engine(ec.warmup_record_dir, ec, model_fingerprint,
                                      torch.__version__)
              if ec.warmup_record_dir and ec.torch_device.type == "cpu" and one_rank else None)
    passed = record.load() if record is not None else None
    rep = Warmup(runner).run(progress, WarmupReport(**passed) if passed is not None else None)
    if record is not None and passed is None:
        record.save(dataclasses.asdict(rep))
    if rep.activation_peak_bytes is not None and rep.activation_peak_bytes > rep.activation_planned_bytes:
        raise PlanError(
            f"warm-up measured {rep.activation_peak_bytes:,} B of transient activations, the "
            f"plan counted {rep.activation_planned_bytes:,} B; the plan is wrong for this "
            "model/device, so the server would not be safe to run")
    return rep
