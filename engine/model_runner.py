"""Runs one scheduled step on the device: builds the StepBatch, calls the model, samples.

Owns the tensors of the plan (KV cache, workspace, rope tables); the worst-case warm-up that
turns the plan's arithmetic into a measured peak drives it from engine/warmup.py. Never sizes
anything by what a request asks for.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs
from engine.errors import DeviceAllocationAfterLock
from engine.grammar import TokenBitmask
from engine.memory_plan import MemoryPlan
from engine.model_config import ModelConfig
from engine.models.family import family_class
from engine.prompt_logprobs import (
    PromptSpan,
    prompt_logprob_rows,
    prompt_span,
    score_prompt_spans,
)
from engine.sampler import RowState, TokenLogprobs, sample
from engine.sampling_params import (
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
        # the CUDA allocator's device allocations: at the end of the warm-up (engine/warmup.py)
        # and as last checked (each step compares with it)
        self.allocs_after_warmup: int | None = None
        self.device_alloc_baseline: int | None = None

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

    def forward_logits(self, batch: StepBatch, ws: Workspace, logits: torch.Tensor) -> None:
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
        spans = self.prompt_spans(out.chunks, params, prompts or {})
        with self.ws.scope():
            tokens: list[list[int]] = []
            if not spans and self.graphs is not None and self.graphs.can_run(out.chunks):
                self.tell("graph_step", out.chunks)  # every rank replays the same graph
                self.model.before_graph_step(self.kv, out.chunks)
                logits = self.graphs.run(out.chunks)
                self.model.after_graph_step(self.kv, out.chunks)
                self.num_graph_steps += 1
            else:
                self.tell("forward", out.chunks, False)
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
        self.check_device_allocations()
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

    def prompt_spans(self, chunks: list[ScheduledChunk], params: Mapping[str, SamplingParams],
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

    def tell(self, op: str, *args: Any) -> None:
        """Rank 0 of several: have the other ranks do ``op`` too (engine/parallel/follower.py)."""
        if self.tp is not None and self.tp.is_driver:
            from engine.parallel.rank_group import Command

            self.tp.send(Command(op, args))

    def check_device_allocations(self) -> None:
        if self.device_alloc_baseline is None:
            return
        now = torch.cuda.memory_stats(self.device).get("num_device_alloc", 0)
        if now != self.device_alloc_baseline:
            msg = (f"step {self.num_steps}: the CUDA caching allocator made {now - self.device_alloc_baseline}"
                   f" device allocation(s) after warm-up ({self.device_alloc_baseline} -> {now}); the plan "
                   "under-counted a transient buffer")
            self.device_alloc_baseline = now
            if self.ec.strict_allocations:
                raise DeviceAllocationAfterLock(msg)
            log.warning(msg)

    @property
    def device_allocs_since_warmup(self) -> int | None:
        if self.device_alloc_baseline is None or self.allocs_after_warmup is None:
            return None
        return self.device_alloc_baseline - self.allocs_after_warmup
