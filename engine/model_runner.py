"""Runs one scheduled step on the device: builds the StepBatch, calls the model, samples.

Owns the tensors of the plan (KV cache, workspace, rope tables) and the worst-case warm-up that
turns the plan's arithmetic into a measured peak. Never sizes anything by what a request asks for.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.block_manager import NULL_BLOCK
from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs
from engine.errors import DeviceAllocationAfterLock, PlanError
from engine.grammar import TokenBitmask
from engine.memory_planner import MemoryPlan, reserve_allocator_slack
from engine.model_config import ModelConfig
from engine.models import family_class
from engine.prompt_logprobs import (
    PromptSpan,
    prompt_logprob_rows,
    prompt_span,
    score_prompt_spans,
)
from engine.sampler import RowState, TokenLogprobs, sample
from engine.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_PROMPT_LOGPROBS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from engine.scheduler import ScheduledChunk, SchedulerOutput
from engine.slot_sampling import SlotSampling
from engine.spec_decode import verify
from engine.step_batch import StepBatch
from engine.workspace import Workspace

log = logging.getLogger(__name__)


class KVImport(Protocol):
    def __call__(self, kv: Any, block_ids: list[int], num_prompt_tokens: int, *,
                 num_computed_tokens: int = 0) -> int:
        """Fill the leading tokens' KV into ``block_ids`` (of the engine's ``kv`` storage, in
        the family's layout); tokens below ``num_computed_tokens`` are there already (prefix
        cache, maybe shared) and must not be written. Return how many leading tokens are filled.
        """
        ...


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


class ModelRunner:
    def __init__(self, model_cfg: ModelConfig, ec: EngineConfig, weights: dict[str, torch.Tensor],
                 plan: MemoryPlan, tp: Any = None) -> None:
        """``tp``: this rank's ``engine.parallel.rank_group.RankGroup`` (``model_cfg`` and
        ``weights`` are then the rank's share). On rank 0 every model call is announced to the
        other ranks first, so they run the same forward on their shards."""
        self.model_cfg = model_cfg
        self.tp = tp
        self.ec = ec
        self.plan = plan
        self.device = ec.torch_device
        self.dtype = ec.torch_dtype
        self.block_size = ec.block_size
        self.kv = plan.kv_layout.allocate(plan.num_blocks, self.device)
        # imported KV passes through here on its way from host rows into the blocks, a bounded
        # slice per step (engine/kv_import_job.py); None: nothing to import through
        self.import_buffer: torch.Tensor | None = None
        if plan.term("kv_import_slice"):
            self.import_buffer = torch.empty(
                (plan.term("kv_import_slice") // plan.kv_layout.bytes_per_block,
                 plan.kv_layout.bytes_per_block), dtype=torch.uint8, device=self.device)
        self.ws = Workspace(plan.workspace_bytes, self.device)
        family = family_class(model_cfg)
        self.model = family(model_cfg, weights, ec) if tp is None else \
            family(model_cfg, weights, ec, tp=tp)
        # Decode graphs need a step whose host-side work is all in the inputs.
        # (an instance may say no where its class could, e.g. for experts looped on the host)
        # Several ranks: only over NCCL, whose all-reduce a graph can capture (gloo stays eager).
        self.use_graphs = ec.use_cuda_graphs and self.model.uses_cuda_graphs and (
            tp is None or tp.can_capture)
        self.num_steps = 0
        # One sampling generator per running slot, made once: creating a CUDA generator takes
        # device memory, so requests re-seed these instead of making their own.
        self.generators = [torch.Generator(self.device) for _ in range(ec.max_batch)]
        # Penalty counts, logit bias and min_tokens stop ids, one row per slot (a plan term).
        self.slot_sampling = SlotSampling(ec.max_batch, model_cfg.vocab_size, self.device,
                                          stage_tokens=ec.chunk_tokens)
        # the last step's, by request id: one per token it gave (several in a verify step)
        self.last_logprobs: dict[str, list[TokenLogprobs]] = {}
        # the last step's prompt scores: request id -> (prompt position of the first, items)
        self.last_prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = {}
        # the last step's sequences no token could be drawn for: request id -> why
        self.last_errors: dict[str, str] = {}
        # one row per sampled logits row: a verify step masks each draft's row too
        self.bitmask = TokenBitmask(ec.verify_rows, model_cfg.vocab_size, self.device)
        self.graphs: DecodeGraphs | None = None
        self.num_graph_steps = 0
        self.capture_logits: set[str] = set()  # request ids whose next logits row is kept
        self.captured_logits: dict[str, torch.Tensor] = {}
        self.warmup_report: WarmupReport | None = None
        self._device_allocs: int | None = None

    # -- one step -------------------------------------------------------------------------------
    def build_batch(self, chunks: list[ScheduledChunk]) -> StepBatch:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qsl = [0]
        logits_rows = []
        for c in chunks:
            ids.extend(c.token_ids)
            for p in range(c.start, c.start + c.num_tokens):
                pos.append(p)
                slots.append(c.block_ids[p // bs] * bs + p % bs)
            qsl.append(qsl[-1] + c.num_tokens)
            logits_rows.extend(range(qsl[-1] - c.num_logits_rows, qsl[-1]))
        kernel_meta = {}
        if self.ec.use_triton_attention:
            width = max(len(c.block_ids) for c in chunks)
            table = torch.zeros(len(chunks), width, dtype=torch.int32)
            for i, c in enumerate(chunks):
                table[i, : len(c.block_ids)] = torch.tensor(c.block_ids, dtype=torch.int32)
            kernel_meta = dict(
                block_tables_t=self._stage(table, "model_runner.block_tables"),
                query_start_loc_t=self._stage(torch.tensor(qsl, dtype=torch.int32),
                                              "model_runner.query_start_loc"),
                context_lens_t=self._stage(torch.tensor([c.context_len for c in chunks],
                                                        dtype=torch.int32),
                                           "model_runner.context_lens"),
            )
        i64 = torch.int64
        return StepBatch(
            input_ids=self._stage(torch.tensor(ids, dtype=i64), "model_runner.input_ids"),
            positions=self._stage(torch.tensor(pos, dtype=i64), "model_runner.positions"),
            slot_mapping=self._stage(torch.tensor(slots, dtype=i64), "model_runner.slot_mapping"),
            query_start_loc=qsl,
            context_lens=[c.context_len for c in chunks],
            block_tables=[list(c.block_ids) for c in chunks],
            cache_slots=[c.cache_slot for c in chunks],
            first_chunks=[c.is_first for c in chunks],
            num_draft_tokens=[c.num_draft_tokens for c in chunks],
            logits_indices=self._stage(torch.tensor(logits_rows, dtype=i64),
                                       "model_runner.logits_indices"),
            **kernel_meta,
        )

    def _stage(self, host: torch.Tensor, caller: str) -> torch.Tensor:
        """Copy a step input into the workspace (valid for the current scope): the host-to-device
        copy allocates nothing, so step inputs never fragment the device allocator's pools."""
        out = self.ws.take(tuple(host.shape), host.dtype, caller=caller)
        out.copy_(host)
        return out

    def _forward_logits(self, batch: StepBatch, ws: Workspace, logits: torch.Tensor) -> None:
        hidden = self.model.forward(batch, self.kv, ws)
        self.model.compute_logits(hidden.index_select(0, batch.logits_indices), logits)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, params: dict[str, SamplingParams],
                generators: dict[str, torch.Generator | None],
                rows: dict[str, RowState] | None = None,
                matchers: dict[str, Any] | None = None,
                prompts: Mapping[str, Sequence[int]] | None = None) -> dict[str, list[int]]:
        """Run one step; -> the tokens each sampling request gets: one, or in a verify step
        (chunks with drafts, engine/spec_decode.py) its accepted drafts and one more. ``rows``
        gives each sampled request's slot state (penalties, min_tokens); logprobs asked for
        land in ``last_logprobs``. ``prompts``: the prompt of each request with
        ``prompt_logprobs``; its chunk's scores land in ``last_prompt_logprobs`` as (first
        position, items)."""
        sampled = [c for c in out.chunks if c.do_sample]
        sampled_ids = [c.request_id for c in sampled]
        num_rows = sum(c.num_logits_rows for c in sampled)
        is_verify = num_rows > len(sampled)
        self.last_logprobs = {}
        self.last_prompt_logprobs = {}
        self.last_errors = {}
        spans = self._prompt_spans(out.chunks, params, prompts or {})
        with self.ws.scope():
            tokens: list[list[int]] = []
            if not spans and self.graphs is not None and self.graphs.can_run(out.chunks):
                self._tell("graph_step", out.chunks)  # every rank replays the same graph
                self.model.before_graph_step(self.kv, out.chunks)
                logits = self.graphs.run(out.chunks)
                self.model.after_graph_step(self.kv, out.chunks)
                self.num_graph_steps += 1
            else:
                self._tell("forward", out.chunks, False)
                batch = self.build_batch(out.chunks)
                hidden = self.model.forward(batch, self.kv, self.ws)
                logits = None
                if sampled_ids:
                    logits = self.ws.take((num_rows, self.model_cfg.vocab_size),
                                          torch.float32, caller="model_runner.logits")
                    self.model.compute_logits(hidden.index_select(0, batch.logits_indices),
                                              logits)
                if spans:
                    self._score_prompts(hidden, spans)
            if sampled_ids:
                row = 0
                for c in sampled:  # off the hot path: tests and scoring only
                    if c.request_id in self.capture_logits:
                        self.captured_logits[c.request_id] = logits[row].clone().cpu()
                    row += c.num_logits_rows
                if is_verify:
                    tokens = self._verify(logits, sampled, params, generators, rows, matchers)
                else:
                    result = sample(logits, [params[r] for r in sampled_ids],
                                    [generators.get(r) for r in sampled_ids], self.ws,
                                    None if rows is None else [rows[r] for r in sampled_ids],
                                    self.slot_sampling, self.bitmask,
                                    [matchers.get(r) for r in sampled_ids] if matchers else None)
                    tokens = [[t] for t in result.tokens]
                    self.last_errors = {sampled_ids[i]: why for i, why in result.errors.items()}
                    self.last_logprobs = {r: [lp] for r, lp in zip(sampled_ids, result.logprobs,
                                                                    strict=True)
                                          if lp is not None}
        self.num_steps += 1
        self._check_device_allocations()
        return dict(zip(sampled_ids, tokens, strict=True))

    def _verify(self, logits: torch.Tensor, sampled: list[ScheduledChunk],
                params: Mapping[str, SamplingParams],
                generators: Mapping[str, torch.Generator | None],
                rows: Mapping[str, RowState] | None,
                matchers: Mapping[str, Any] | None) -> list[list[int]]:
        """A step with drafts: every sampled chunk's rows through engine/spec_decode.py."""
        ids = [c.request_id for c in sampled]
        assert rows is not None, "a verify step needs each row's slot state"
        result = verify(logits, [params[r] for r in ids], [c.draft_token_ids for c in sampled],
                        [generators.get(r) for r in ids], self.ws, [rows[r] for r in ids],
                        self.slot_sampling, self.bitmask,
                        [matchers.get(r) for r in ids] if matchers else None)
        self.last_errors = {ids[i]: why for i, why in result.errors.items()}
        self.last_logprobs = {r: lp for r, lp in zip(ids, result.logprobs, strict=True)
                              if lp is not None}
        return result.tokens

    def _prompt_spans(self, chunks: list[ScheduledChunk], params: Mapping[str, SamplingParams],
                      prompts: Mapping[str, Sequence[int]]) -> list[PromptSpan]:
        spans = []
        row = 0
        for c in chunks:
            k = params[c.request_id].prompt_logprobs
            if k is not None and c.request_id in prompts:
                span = prompt_span(c.request_id, row, c.start, c.num_tokens,
                                   prompts[c.request_id], k)
                if span is not None:
                    spans.append(span)
            row += c.num_tokens
        return spans

    def _score_prompts(self, hidden: torch.Tensor, spans: list[PromptSpan]) -> None:
        rows = prompt_logprob_rows(self.ec.chunk_tokens, self.ec.max_batch)
        scored = score_prompt_spans(hidden, spans, rows, self.model_cfg.vocab_size,
                                    self.model.compute_logits, self.ws)
        self.last_prompt_logprobs = {s.request_id: (s.start + 1, scored[s.request_id])
                                     for s in spans}

    # -- warm-up --------------------------------------------------------------------------------
    def warmup(self, progress: Callable[[str], None] | None = None,
               passed: WarmupReport | None = None) -> WarmupReport:
        """Run the family's worst-case steps of the plan (the longest chunk against the longest
        context, a full batch of decodes at the longest context, ...); KV writes of the dense
        families go to the null block, others' to blocks no sequence holds yet. ``progress``
        (optional) is told each step before it runs. ``passed`` (CPU only): the report of
        these very steps having passed before (engine/warmup_record.py); they are skipped."""
        cuda = self.device.type == "cuda"
        if passed is not None:
            assert not cuda and self.tp is None, "a warm-up is skipped on one CPU rank only"
            if progress is not None:
                progress("warm-up skipped: passed before with this model, config and code")
            self.ws.lock()
            self.model.reset(self.kv)
            self.num_steps = 0
            self.warmup_report = passed
            return passed
        if cuda:
            # Garbage from loading (a reference cycle that still holds device tensors) must go
            # before the baseline: collected mid-warm-up, its bytes would be reused by the
            # steps' transients and the peak above the baseline would read low.
            gc.collect()
            torch.cuda.synchronize(self.device)
            base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        steps, names = self._warmup_steps()
        self._run_warmup_steps(steps, progress, names)
        self._warm_import()
        act_peak = None
        if cuda:
            torch.cuda.synchronize(self.device)
            act_peak = torch.cuda.max_memory_allocated(self.device) - base
        self.ws.lock()
        self._tell("lock")
        if self.use_graphs:
            if progress is not None:
                progress("capturing CUDA graphs")
            self._capture_graphs()
        if cuda:
            self._settle(steps, names, progress)
        self.model.reset(self.kv)
        self._tell("reset")
        self.num_steps = 0
        self.warmup_report = WarmupReport(self.ws.peak_bytes, self.ws.capacity, act_peak,
                                          self.plan.term("activations"), self._device_allocs)
        return self.warmup_report

    def _warmup_steps(self) -> tuple[list, list[str]]:
        """The family's worst-case steps of the plan, and a name for each."""
        usable = self.plan.num_blocks - 1
        table = tuple(1 + (i % usable) for i in range(self.ec.blocks_per_seq))
        steps = self.model.warmup_steps(self.ec, table)
        names = [f"{len(c)} sequence(s), {sum(x.num_tokens for x in c)} tokens up to context "
                 f"{max(x.context_len for x in c)}" for c in steps]
        if self.ec.spec_tokens:
            steps.append(verify_warmup_step(self.ec, table))
            names.append(f"verify {len(steps[-1])} sequence(s), "
                         f"{sum(c.num_logits_rows for c in steps[-1])} logits rows "
                         f"(up to {self.ec.spec_tokens} drafts each)")
        return steps, names

    def _settle(self, steps: list, names: list[str],
                progress: Callable[[str], None] | None) -> None:
        """After a capture (CUDA): torch.cuda.graph() empties the allocator's cache before it
        captures, so run the worst steps again for the cache to hold what serving needs, leave
        the planned slack, then take the allocation baseline."""
        self._run_warmup_steps(steps, progress, names)
        self._warm_import()
        reserve_allocator_slack(self.device, self.plan.term("allocator_slack"))
        torch.cuda.synchronize(self.device)
        self._device_allocs = torch.cuda.memory_stats(self.device).get("num_device_alloc", 0)

    def recapture_graphs(self, progress: Callable[[str], None] | None = None) -> None:
        """Capture the decode graphs again after a change to how the model runs its step (a
        benchmark comparing one model option on the same weights, without building them
        twice): the old graphs and their pool go first, then the warm-up's capture, re-run and
        allocation baseline (``device_allocs_since_warmup`` counts from here on). The caller
        (``LLMEngine.recapture_graphs``) makes sure that no block is in use: the re-run writes
        into blocks as the warm-up does. One rank only."""
        if self.graphs is None:
            return
        if self.tp is not None:
            raise PlanError("recapture_graphs: not with several ranks (they capture in step)")
        self.graphs = None
        gc.collect()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # the old graphs' pool back to the device before the new one
        self._capture_graphs()
        steps, names = self._warmup_steps()
        self._settle(steps, names, progress)
        self.model.reset(self.kv)
        assert self.warmup_report is not None
        self.warmup_report = dataclasses.replace(self.warmup_report,
                                                 device_allocs_after_warmup=self._device_allocs)

    @torch.inference_mode()
    def _warm_import(self) -> None:
        """A full slice of the KV import path (engine/kv_import_job.py) into the null block with
        its own bytes, so nothing changes: the kernels load and the allocator caches what a
        serving slice takes, before the allocation baseline."""
        buf, layout = self.import_buffer, self.plan.kv_layout
        if buf is None:
            return
        row = layout.export_blocks(self.kv, [NULL_BLOCK]).cpu()
        buf.copy_(row.expand(buf.shape[0], -1), non_blocking=True)
        layout.import_blocks(self.kv, [NULL_BLOCK] * buf.shape[0], buf)

    def _run_warmup_steps(self, steps: list[list[ScheduledChunk]],
                          progress: Callable[[str], None] | None = None,
                          names: Sequence[str] = ()) -> None:
        vocab = self.model_cfg.vocab_size
        # Every sampler stage at its largest: full logit bias and stop lists, penalties, min_p,
        # min_tokens holding, the most logprobs; greedy rows with processors too.
        extra = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
                     logit_bias=tuple((t % vocab, 1.0) for t in range(MAX_LOGIT_BIAS)),
                     stop_token_ids=tuple(t % vocab for t in range(MAX_STOP_TOKEN_IDS)),
                     min_tokens=1, logprobs=MAX_LOGPROBS, max_tokens=2)
        # greedy rows also score their prompt rows (the largest chunk scores all of its rows)
        greedy = SamplingParams(temperature=0.0, prompt_logprobs=MAX_PROMPT_LOGPROBS, **extra)
        random = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.05, seed=0, **extra)
        prompt = (0,) * min(self.ec.chunk_tokens, self.ec.max_context - 1)
        for k, chunks in enumerate(steps):
            if progress is not None:
                progress(f"warm-up {k + 1}/{len(steps)}: {names[k] if k < len(names) else ''}")
            self.model.prepare_warmup(self.kv, chunks)
            self._tell("prepare_warmup", chunks)
            params = {c.request_id: (random if i % 2 else greedy) for i, c in enumerate(chunks)}
            rows = {}
            with torch.inference_mode():
                for c in chunks:
                    sp = params[c.request_id]
                    self.slot_sampling.admit(c.cache_slot, sp, prompt, (1,), sp.stop_token_ids,
                                             self.ws)
                    rows[c.request_id] = RowState(c.cache_slot, 0)
            gens = {c.request_id: self.generators[c.cache_slot].manual_seed(0) for c in chunks}
            self._execute_warmup(chunks, params, gens, rows)

    def _capture_graphs(self) -> None:
        """Capture the decode graphs; on rank 0 of several, the other ranks capture the same
        sizes in the same order at the same time (their all-reduces pair up)."""
        ec = self.ec
        self._tell("capture")
        self.graphs = DecodeGraphs(self._forward_logits, self.ws, self.model_cfg.vocab_size,
                                   ec.max_batch, ec.blocks_per_seq, ec.block_size, self.device,
                                   pad_with_first=self.model.graph_pads_copy_first,
                                   capture_error_mode="global" if self.tp is None
                                   else "thread_local")
        with torch.inference_mode():
            self.graphs.capture()
        planned = self.plan.term("cuda_graph_pool")
        if self.graphs.pool_bytes > planned:
            raise PlanError(f"CUDA graph capture took {self.graphs.pool_bytes:,} B, the plan "
                            f"counted {planned:,} B for its pool; refusing to serve on a wrong plan")
        if self.tp is not None:
            outside = self.plan.term("tp.graph_collectives")
            if self.graphs.outside_bytes > outside:
                log.warning("CUDA graph capture took %d B of device memory outside PyTorch "
                            "(NCCL's captured collectives, module loads); the plan counted %d B",
                            self.graphs.outside_bytes, outside)

    def _execute_warmup(self, chunks: list[ScheduledChunk], params: dict[str, SamplingParams],
                        gens: dict[str, torch.Generator], rows: dict[str, RowState]) -> None:
        sampled_ids = [c.request_id for c in chunks]
        self._tell("forward", chunks, True)
        with torch.inference_mode(), self.ws.scope():
            batch = self.build_batch(chunks)
            batch.slot_mapping.fill_(NULL_BLOCK)  # warm-up writes land in the null block only
            hidden = self.model.forward(batch, self.kv, self.ws)
            num_rows = sum(c.num_logits_rows for c in chunks)
            logits = self.ws.take((num_rows, self.model_cfg.vocab_size), torch.float32,
                                  caller="model_runner.logits")
            self.model.compute_logits(hidden.index_select(0, batch.logits_indices), logits)
            if num_rows > len(chunks):  # the verify step: drafts of token 0 after token 0
                verify(logits, [params[r] for r in sampled_ids],
                       [c.draft_token_ids for c in chunks], [gens[r] for r in sampled_ids],
                       self.ws, [rows[r] for r in sampled_ids], self.slot_sampling,
                       self.bitmask, [None] * len(sampled_ids))
                return
            # every row of a chunk scored as a prompt row (targets: token 0, valid for any vocab)
            spans = self._prompt_spans(chunks, params, {
                c.request_id: (0,) * (c.start + c.num_tokens + 1) for c in chunks})
            if spans:
                score_prompt_spans(hidden, spans, prompt_logprob_rows(self.ec.chunk_tokens,
                                                                      self.ec.max_batch),
                                   self.model_cfg.vocab_size, self.model.compute_logits, self.ws)
            sample(logits, [params[r] for r in sampled_ids], [gens[r] for r in sampled_ids],
                   self.ws, [rows[r] for r in sampled_ids], self.slot_sampling, self.bitmask,
                   [None] * len(sampled_ids))  # an all-ones mask: the copy and the kernel run

    def _tell(self, op: str, *args: Any) -> None:
        """Rank 0 of several: have the other ranks do ``op`` too (engine/parallel/follower.py)."""
        if self.tp is not None and self.tp.is_driver:
            from engine.parallel.rank_group import Command

            self.tp.send(Command(op, args))

    def _check_device_allocations(self) -> None:
        if self._device_allocs is None:
            return
        now = torch.cuda.memory_stats(self.device).get("num_device_alloc", 0)
        if now != self._device_allocs:
            msg = (f"step {self.num_steps}: the CUDA caching allocator made {now - self._device_allocs}"
                   f" device allocation(s) after warm-up ({self._device_allocs} -> {now}); the plan "
                   "under-counted a transient buffer")
            self._device_allocs = now
            if self.ec.strict_allocations:
                raise DeviceAllocationAfterLock(msg)
            log.warning(msg)

    @property
    def device_allocs_since_warmup(self) -> int | None:
        if self._device_allocs is None or self.warmup_report is None:
            return None
        return self._device_allocs - (self.warmup_report.device_allocs_after_warmup or 0)
