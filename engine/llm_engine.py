"""The engine both workers share: requests in, tokens out, memory fixed at start-up.

``LLMEngine.from_config`` loads the checkpoint, makes the memory plan (refusing one that does not
fit), allocates the KV extent and the workspace, runs the worst-case warm-up and locks. After that
a request either fits the plan (checked in ``add_request``, before any compute) or is refused.
The engine takes ownership of the ``weights`` dict it is given: with the fused CUDA path the dense
families replace q/k/v and gate/up by concatenated copies and drop the originals from it.
Single-threaded: one thread owns the engine and the device.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.config_resolve import resolve_config_before_load, resolve_engine_config
from engine.errors import (
    ContextLengthExceeded,
    DuplicateRequest,
    EngineError,
    InvalidRequest,
    PlanError,
    QueueFull,
    SequenceFailed,
    StepFailed,
)
from engine.grammar import new_matcher
from engine.kv_import_job import KVImporter
from engine.memory_planner import MemoryPlan, device_memory, library_workspaces, make_plan
from engine.model_config import ModelConfig
from engine.model_runner import KVImport, ModelRunner, WarmupReport
from engine.models import family_class
from engine.models.family import KVLayout
from engine.ngram_drafter import NgramDrafter
from engine.outputs import EngineStats, RequestOutput
from engine.sampler import RowState
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import Sequence, SequenceStatus
from engine.staged_kv import StagedKV
from engine.step_isolation import StepIsolator
from engine.warmup_record import WarmupRecord
from engine.weight_share import SharedWeights

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, ec: EngineConfig, model_config: ModelConfig,
                 weights: dict[str, torch.Tensor], model_fingerprint: str = "",
                 non_torch_bytes: int = 0,
                 progress: Callable[[str], None] | None = None,
                 shared: SharedWeights | None = None, ranks: Any = None) -> None:
        """``progress``, when given, is told each start-up step in words (the worker prints
        them: on a small machine the warm-up alone takes tens of seconds). ``shared``: the
        weights are views into one arena (one-box mode), owned here or mapped from another
        process; the plan counts it as owned weights or as ``weights_mapped``. ``ranks``
        (engine/parallel/ranks.py, with ``tensor_parallel_size`` > 1): the other ranks, already
        started; ``weights`` are then rank 0's share and the plan is rank 0's."""
        self.model_fingerprint = model_fingerprint
        self.shared_weights = shared
        self.ranks = ranks
        rank_cfg, shard, family = model_config, None, family_class(model_config)
        if ranks is not None:
            from engine.parallel.shard_plan import ShardPlan

            rank_cfg = family.rank_model_config(model_config, ranks.size)
            if family.tensor_parallel_kv == "heads":
                shard = ShardPlan(model_config, 0, ranks.size)
        mapped = 0
        if shared is None:
            # quantized payloads count as the model will hold them (stored, or dequantized)
            weight_bytes = family.resident_weight_bytes(weights, ec)
        else:
            weight_bytes = shared.nbytes if shared.owned else 0
            mapped = 0 if shared.owned else shared.nbytes
        memory, library = device_memory(ec), library_workspaces(ec)

        def plan_for(c: EngineConfig) -> MemoryPlan:
            return make_plan(rank_cfg, c, memory, weight_bytes, non_torch_bytes, library,
                             mapped_weight_bytes=mapped)

        if not ec.is_resolved:  # sizes left to the model (engine/config_resolve.py)
            ec = resolve_engine_config(ec, model_config, lambda c: plan_for(c).fits)
        self.config = ec
        self.model_config = model_config
        if ec.spec_tokens and family.speculation_problem is not None:
            raise PlanError(f"speculative_method={ec.speculative_method}: family "
                            f"{model_config.family} cannot verify drafts: "
                            f"{family.speculation_problem}; serve it with speculative_method "
                            "none")
        if ec.spec_tokens and ec.speculative_method not in family.speculative_methods:
            raise PlanError(f"speculative_method={ec.speculative_method}: family "
                            f"{model_config.family} drafts with "
                            f"{', '.join(family.speculative_methods)} only (mtp needs a family "
                            "with multi-token-prediction layers); use one of those or none")
        self.plan: MemoryPlan = plan_for(ec)
        self.plan.check()
        if progress is not None:
            progress(f"memory plan: {self.plan.total_bytes / 2**20:,.0f} MiB of a "
                     f"{self.plan.budget_bytes / 2**20:,.0f} MiB budget, max_context "
                     f"{ec.max_context:,}, max_batch {ec.max_batch}, KV extent "
                     f"{self.plan.num_blocks} blocks of {ec.block_size} tokens "
                     f"({self.plan.kv_tokens:,} tokens, "
                     f"{self.plan.kv_layout.bytes_per_token:,.0f} B a token, kv_dtype "
                     f"{ec.kv_dtype})")
        self.runner = ModelRunner(rank_cfg, ec, weights, self.plan,
                                  tp=None if ranks is None else ranks.group)
        self._kv_view: KVLayout = self.plan.kv_layout
        # a step that raises ends the sequences that raise alone (engine/step_isolation.py)
        self._isolator = StepIsolator(self.runner, rerun_safe=family.rerun_safe,
                                      tensor_parallel=ranks is not None)
        if ranks is not None:  # the KV store sees the one-rank layout, gathered from the ranks
            from engine.parallel.kv_gather import ShardedKVLayout

            self._kv_view = ShardedKVLayout(family.kv_layout(model_config, ec), self.runner, shard,
                                            ranks.group)
        # Every family keeps what a sequence needs to continue in its blocks, so full blocks
        # are shared by prefix hash (the family's layout says where it can resume).
        layout = self.plan.kv_layout
        self.block_manager = BlockManager(
            self.plan.num_blocks, ec.block_size, ec.enable_prefix_cache,
            lambda block: layout.can_resume_after(self.runner.kv, block))
        eos = model_config.eos_token_ids
        self.scheduler = Scheduler(
            SchedulerConfig(ec.max_batch, ec.chunk_tokens, ec.max_context, tuple(eos),
                            family.step_context_limit(ec),
                            restart_rejected_verify=family.restarts_rejected_verify),
            self.block_manager)
        record = (WarmupRecord.for_engine(ec.warmup_record_dir, ec, model_fingerprint,
                                          torch.__version__)
                  if ec.warmup_record_dir and ec.torch_device.type == "cpu" and ranks is None
                  else None)
        passed = record.load() if record is not None else None
        self.warmup_report = self.runner.warmup(
            progress, WarmupReport(**passed) if passed is not None else None)
        rep = self.warmup_report
        if record is not None and passed is None:
            record.save(dataclasses.asdict(rep))
        if rep.activation_peak_bytes is not None and rep.activation_peak_bytes > rep.activation_planned_bytes:
            # The plan under-counted what the worst step really takes: refuse to serve on it.
            raise PlanError(
                f"warm-up measured {rep.activation_peak_bytes:,} B of transient activations, the "
                f"plan counted {rep.activation_planned_bytes:,} B; the plan is wrong for this "
                "model/device, so the server would not be safe to run")
        self._seqs: dict[str, Sequence] = {}
        self._imports: dict[str, KVImport | StagedKV] = {}  # not yet admitted
        self._importer = KVImporter(self._kv_view, self.runner.kv, ec.kv_import_slice_bytes,
                                    self.runner.import_buffer, layout.resume_granularity)
        self._generators: dict[str, torch.Generator | None] = {}
        self._kept: dict[str, Sequence] = {}
        self._pending: list[RequestOutput] = []
        self._arrivals = 0
        self._steps = 0
        self._tokens = 0
        self._preemptions = 0
        self._rng = torch.Generator().manual_seed(ec.seed)
        self._drafter = (NgramDrafter(ec.max_batch, ec.max_context)
                         if ec.speculative_method == "ngram" else None)
        self._spec_drafts = 0
        self._spec_draft_tokens = 0
        self._spec_accepted = 0
        self._spec_accepted_per_pos = [0] * ec.spec_tokens

    @classmethod
    def from_config(cls, ec: EngineConfig,
                    progress: Callable[[str], None] | None = None) -> LLMEngine:
        from engine.checkpoint import load_checkpoint

        if ec.share_weights:
            return cls._shared_from_config(ec, progress)
        ranks = None
        try:
            if ec.tensor_parallel_size > 1:
                from engine.checkpoint import load_model_config
                from engine.parallel.ranks import Ranks
                from engine.parallel.shard_plan import check_tensor_parallel

                # every rank must plan the same sizes: fixed here from the config, before any
                # rank starts (weights as the config says; rank 0's real plan is checked later)
                ec = resolve_config_before_load(ec, load_model_config(ec.model))

                check_tensor_parallel(ec)  # before any process starts
                if progress is not None:
                    progress(f"starting {ec.tensor_parallel_size - 1} more tensor-parallel "
                             "rank(s)")
                ranks = Ranks(ec)  # they load their own slices meanwhile
            non_torch = 0
            if ec.torch_device.type == "cuda":
                free, total = torch.cuda.mem_get_info(ec.torch_device)
                non_torch = total - free - torch.cuda.memory_reserved(ec.torch_device)
            if progress is not None:
                progress(f"making dummy weights for {ec.model} (seed {ec.seed})"
                         if ec.load_format == "dummy" else f"loading weights from {ec.model}")
            ckpt = load_checkpoint(ec.model, dtype=ec.torch_dtype, device=ec.torch_device,
                                   tensor_parallel=(0, ec.tensor_parallel_size),
                                   load_format=ec.load_format, seed=ec.seed)
            if progress is not None:
                num_bytes = sum(t.numel() * t.element_size() for t in ckpt.state_dict.values())
                progress(f"loaded {len(ckpt.state_dict)} tensors ({num_bytes / 2**20:,.0f} MiB, "
                         f"{ckpt.config.name})")
            return cls(ec, ckpt.config, ckpt.state_dict, ckpt.model_fingerprint, non_torch,
                       progress, ranks=ranks)
        except BaseException:
            if ranks is not None:
                ranks.abort()
            raise

    @classmethod
    def _shared_from_config(cls, ec: EngineConfig,
                            progress: Callable[[str], None] | None) -> LLMEngine:
        """One-box mode: load and export the weights, or map another process's export."""
        from pathlib import Path

        from engine.weight_share import export, load_or_map

        got = load_or_map(ec, progress)
        engine = cls(ec, got.config, got.weights, got.model_fingerprint, got.non_torch_bytes,
                     progress, shared=got.shared)
        if got.shared.owned:  # after the warm-up: importers then measure a settled device
            export(got.shared, Path(ec.share_weights),
                   {"model": str(ec.model), "model_fingerprint": got.model_fingerprint})
            if progress is not None:
                progress(f"exported the weights for other processes at {ec.share_weights}")
        return engine

    @property
    def kv_cache(self) -> Any:
        """The KV storage in the family's layout (``kv_layout``)."""
        return self.runner.kv

    @property
    def kv_layout(self) -> KVLayout:
        """The layout blocks are exported and imported in (the one-rank layout at any
        tensor-parallel size; ``plan.kv_layout`` is this rank's storage)."""
        return self._kv_view

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do with one rank)."""
        if self.ranks is not None:
            self.ranks.stop()

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Seq[int], sampling: SamplingParams,
                    *, kv_import: KVImport | StagedKV | None = None, keep_kv: bool = False,
                    first_token_id: int | None = None, grammar: Any = None) -> None:
        """Queue a request, or raise before any compute if the plan cannot hold it.
        ``grammar``: a compiled xgrammar grammar its output must follow. ``kv_import``: fetched
        KV (copied a bounded slice per step) or a hook that fills its blocks at once."""
        ec = self.config
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise InvalidRequest("the prompt is empty: at least one token is needed", "prompt")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {vocab})", "prompt")
        bad_bias = next((t for t, _ in sampling.logit_bias if t >= vocab), None)
        if bad_bias is not None:
            raise InvalidRequest(f"logit_bias: token id {bad_bias} is outside the vocabulary "
                                 f"[0, {vocab})", "logit_bias")
        if len(prompt) + sampling.max_tokens > ec.max_context:
            raise ContextLengthExceeded(len(prompt), sampling.max_tokens, ec.max_context)
        wanted = sampling.num_speculative_tokens
        if wanted is not None and wanted > ec.spec_tokens:
            raise InvalidRequest(
                f"num_speculative_tokens={wanted} is above this worker's limit of "
                f"{ec.spec_tokens} (speculative_method={ec.speculative_method}"
                + (f", num_speculative_tokens={ec.num_speculative_tokens}"
                   if ec.spec_tokens else "") + ")", "num_speculative_tokens")
        if request_id in self._seqs or request_id in self._kept:
            raise DuplicateRequest(f"request id {request_id!r} is already in this engine")
        if len(self.scheduler.waiting) >= ec.max_queue:
            raise QueueFull(f"the waiting queue is full ({ec.max_queue} requests); retry later")
        if sampling.prompt_logprobs is not None:
            # Imported KV comes without logits: the prompt is recomputed here instead (the
            # scheduler refuses the prefix cache for it for the same reason).
            kv_import = None
        seq = Sequence(request_id, prompt, sampling, self._arrivals, keep_kv=keep_kv,
                       has_kv_import=kv_import is not None, grammar=grammar,
                       added_s=time.monotonic())
        if sampling.prompt_logprobs is not None:
            seq.prompt_logprobs = [None] * len(prompt)
        self._arrivals += 1
        self._seqs[request_id] = seq
        # The seed is fixed now; the generator is one of the per-slot ones, bound at admission
        # (a CUDA generator allocates device memory when created, so none is made per request).
        seq.seed = sampling.seed if sampling.seed is not None else int(
            torch.randint(0, 2**62, (1,), generator=self._rng))
        if kv_import is not None:
            self._imports[request_id] = kv_import
        if first_token_id is not None:
            seq.external_first_token = True
            seq.output_token_ids.append(int(first_token_id))
            reason = self.scheduler.finish_reason(seq, int(first_token_id))
            if reason is not None:
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = reason
                self._pending.append(self._output(seq, [], True, reason))
                self._forget(seq)
                return
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return self.release(request_id)
        self._pending.append(self._output(seq, [], True, "abort"))
        self._forget(seq)
        return True

    def recapture_graphs(self, progress: Callable[[str], None] | None = None) -> None:
        """Capture the decode graphs again (after a change to a model option that a step reads,
        for a benchmark's A/B on the same weights; ``ModelRunner.recapture_graphs``). Only while
        no block is in use; the cached prefixes are forgotten, since the warm-up's re-run
        writes over free blocks."""
        if self.has_unfinished() or self._imports:
            raise EngineError("recapture_graphs: requests are still running or importing")
        try:
            self.block_manager.forget_cached_prefixes()
        except RuntimeError as e:
            raise EngineError(f"recapture_graphs: {e}") from None
        self.runner.recapture_graphs(progress)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    def kept_kv(self, request_id: str) -> tuple[list[int], int]:
        seq = self._kept[request_id]
        return list(seq.block_ids), seq.num_computed_tokens

    def release(self, request_id: str) -> bool:
        seq = self._kept.pop(request_id, None)
        if seq is None:
            return False
        self.block_manager.free(seq.block_ids)
        seq.block_ids = []
        return True

    # -- stepping -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        if self.config.spec_tokens:
            self._propose_drafts()
        sched = self.scheduler.schedule()
        self._preemptions += len(sched.preempted)
        for rid in sched.preempted:
            gen = self._generators.pop(rid, None)
            seq = self._seqs.get(rid)
            if gen is not None and seq is not None:
                seq.rng_state = gen.get_state()
            if seq is not None and seq.has_kv_import:  # it recomputes: its import goes
                seq.has_kv_import = False
                self._imports.pop(rid, None)
                self._importer.cancel(rid)
        for rid in sched.admitted:
            self._on_admit(self._seqs[rid])
        for load in sched.kv_loads:
            # the import runs once: its source, and the host memory holding what it fetched,
            # go when its last slice is in rather than when the request ends
            source = self._imports.pop(load.request_id, None)
            if source is None:  # preempted mid-import and re-admitted in this very step
                self.scheduler.apply_kv_load(load.request_id, 0)
            else:
                self._importer.start(load, source)
        copied = self._importer.blocks_copied
        with torch.inference_mode():  # a slice of each import, before this step's forward
            for rid, n in self._importer.step().items():
                self.scheduler.apply_kv_load(rid, n)
                self._seqs[rid].has_kv_import = False
        if not sched.chunks:
            # an import-only step is progress too (the router's stall watch reads steps)
            self._steps += self._importer.blocks_copied > copied
            return outputs
        params = {c.request_id: self._seqs[c.request_id].sampling for c in sched.chunks}
        rows = {c.request_id: RowState(c.cache_slot,
                                       len(self._seqs[c.request_id].output_token_ids))
                for c in sched.chunks if c.do_sample}
        matchers = {rid: self._seqs[rid].matcher for rid in rows
                    if self._seqs[rid].matcher is not None}
        # A grammar already complete (a decode worker continuing after the prefill's last
        # allowed token): the output ends, ignore_eos notwithstanding; its row is not masked.
        complete = [rid for rid, m in matchers.items() if m.is_terminated()]
        for rid in complete:
            del matchers[rid]
        prompts = {c.request_id: self._seqs[c.request_id].prompt_token_ids for c in sched.chunks
                   if self._seqs[c.request_id].prompt_logprobs is not None}
        ran = self._isolator.execute(sched, params, self._generators, rows, matchers, prompts)
        for rid, why in ran.raised.items():  # its step raised: it ends alone, the others go on
            log.error("%s ended alone: the step running it raised %s", rid, why)
            matchers.pop(rid, None)
            if rid in complete:
                complete.remove(rid)
            outputs.append(self._end(rid, "error", StepFailed(
                f"the engine step running this request raised {why}; this request was ended "
                "alone, the worker and its other requests go on")))
        sched, sampled, logprobs = ran.sched, ran.sampled, ran.logprobs
        if not sched.chunks:
            return outputs
        for rid, (first, items) in ran.prompt_logprobs.items():
            scores = self._seqs[rid].prompt_logprobs
            assert scores is not None
            scores[first : first + len(items)] = items
        # A sequence no token could be drawn for ends alone, with the reason; the others go on.
        failed = dict(ran.errors)
        done_now = set()  # their grammar took its last token in this step
        for rid, m in matchers.items():
            if rid in failed:
                continue
            for i, token in enumerate(sampled[rid]):
                if not _accepts(m, token):  # the mask allowed it: should never happen
                    failed[rid] = (f"the sequence cannot continue: its grammar refused token "
                                   f"{token}, which it had allowed")
                    break
                if m.is_terminated():
                    done_now.add(rid)
                    sampled[rid] = sampled[rid][: i + 1]
                    break
        self._count_drafts(sched, sampled, failed)
        for rid in complete:  # the token drawn for it (unconstrained) is dropped
            failed.pop(rid, None)
            outputs.append(self._end(rid, "stop"))
        for rid, why in failed.items():
            log.warning("%s ended alone: %s", rid, why)
            outputs.append(self._end(rid, "error", SequenceFailed(why)))
        self._steps += 1
        self._tokens += sched.num_tokens
        now_s = time.monotonic()
        for u in self.scheduler.update_from_output(sched, sampled):
            seq = self._seqs[u.request_id]
            if u.new_token_ids and seq.first_token_s is None:
                seq.first_token_s = now_s
            finished, reason = u.finished, u.finish_reason
            if not finished and u.request_id in done_now:
                self.scheduler.finish(u.request_id, "stop")
                finished, reason = True, "stop"
            out = self._output(seq, list(u.new_token_ids), finished, reason)
            if seq.sampling.logprobs is not None and u.request_id in logprobs and u.new_token_ids:
                out.logprobs = logprobs[u.request_id][: len(u.new_token_ids)]
            if seq.prompt_logprobs is not None:  # the prompt is all computed: hand them out once
                out.prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None
            outputs.append(out)
            if finished:
                if seq.keep_kv:
                    self._kept[seq.request_id] = seq
                self._forget(seq)
        return outputs

    def final_logits(self, prompt_token_ids: Seq[int], request_id: str = "score") -> torch.Tensor:
        """Logits [vocab] fp32 at the prompt's last position, computed through the same chunked
        path as serving (for tests and scoring). Runs the engine until the request is done."""
        self.runner.capture_logits.add(request_id)
        try:
            self.add_request(request_id, prompt_token_ids, SamplingParams(max_tokens=1,
                                                                          temperature=0.0))
            while request_id not in self.runner.captured_logits:
                if not self.step() and not self.has_unfinished():
                    raise RuntimeError(f"{request_id} finished without logits")
            return self.runner.captured_logits.pop(request_id)
        finally:
            self.runner.capture_logits.discard(request_id)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            free_kv_tokens=self.block_manager.num_free_blocks * self.config.block_size,
            steps_completed=self._steps, tokens_advanced=self._tokens,
            num_preemptions=self._preemptions,
            device_allocs_since_warmup=self.runner.device_allocs_since_warmup,
            spec_num_drafts=self._spec_drafts, spec_num_draft_tokens=self._spec_draft_tokens,
            spec_num_accepted_tokens=self._spec_accepted,
            spec_accepted_per_pos=tuple(self._spec_accepted_per_pos))

    # -- internals ------------------------------------------------------------------------------
    def _propose_drafts(self) -> None:
        """Each running decode's drafts for this step (n-gram: engine/ngram_drafter.py; mtp:
        the family's draft layers, all decodes in one call), at most its request's number, cut
        so that its output stays within max_tokens and max_context, and to what its grammar
        accepts (a draft that would complete the grammar is cut too: the token that completes
        it is always a row's own draw)."""
        ec = self.config
        wanted: list[tuple[Any, int]] = []
        for seq in self.scheduler.running:
            seq.draft_token_ids = []
            if seq.is_importing or seq.num_uncomputed != 1:
                continue
            sp = seq.sampling
            k = ec.spec_tokens if sp.num_speculative_tokens is None else sp.num_speculative_tokens
            k = min(k, sp.max_tokens - len(seq.output_token_ids) - 1,
                    ec.max_context - seq.num_tokens)
            if k > 0:
                wanted.append((seq, k))
        if self._drafter is not None:
            proposed = []
            for seq, k in wanted:
                self._drafter.sync(seq.cache_slot, seq)
                proposed.append(self._drafter.propose(seq.cache_slot, k))
        elif wanted:
            proposed = self.runner.model.propose_drafts(self.runner.kv, [
                (seq.cache_slot, seq.token_slice(seq.num_tokens - 1, seq.num_tokens)[0],
                 seq.num_tokens - 1, k, list(seq.block_ids)) for seq, k in wanted])
        else:
            proposed = []
        for (seq, _k), drafts in zip(wanted, proposed, strict=True):
            if drafts and seq.matcher is not None:
                drafts = _grammar_prefix(seq.matcher, drafts)
            seq.draft_token_ids = drafts

    def _count_drafts(self, sched: Any, sampled: dict[str, list[int]],
                      failed: dict[str, str]) -> None:
        for c in sched.chunks:
            if not c.num_draft_tokens or c.request_id in failed:
                continue
            accepted = len(sampled.get(c.request_id, ())) - 1
            self._spec_drafts += 1
            self._spec_draft_tokens += c.num_draft_tokens
            self._spec_accepted += accepted
            for i in range(accepted):
                self._spec_accepted_per_pos[i] += 1

    def _on_admit(self, seq: Sequence) -> None:
        """A sequence was given a cache slot in this step: its sampling state and generator."""
        if seq.admitted_s is None:  # a preempted one re-admitted keeps its first admission
            seq.admitted_s = time.monotonic()
        sp = seq.sampling
        stops = list(sp.stop_token_ids)
        if not sp.ignore_eos:
            stops += [t for t in self.model_config.eos_token_ids if t not in stops]
        self.runner.slot_sampling.admit(seq.cache_slot, sp, seq.prompt_token_ids,
                                        seq.output_token_ids, stops, self.runner.ws)
        if seq.grammar is not None:
            seq.matcher = new_matcher(seq.grammar, seq.output_token_ids)
        if self._drafter is not None:
            self._drafter.reset(seq.cache_slot)
        if not seq.sampling.is_greedy:
            gen = self.runner.generators[seq.cache_slot]
            if seq.rng_state is not None:  # resumed after preemption: continue the same stream
                gen.set_state(seq.rng_state)
            else:
                gen.manual_seed(seq.seed)
            self._generators[seq.request_id] = gen

    def _end(self, request_id: str, reason: str,
             error: EngineError | None = None) -> RequestOutput:
        """End a running sequence outside the scheduler's own rules, with no new token."""
        seq = self.scheduler.finish(request_id, reason)
        assert seq is not None, f"{request_id} is not running"
        out = self._output(seq, [], True, reason)
        out.error = error
        if seq.keep_kv and error is None:
            self._kept[seq.request_id] = seq
        self._forget(seq)
        return out

    def _output(self, seq: Sequence, new: list[int], finished: bool,
                reason: str | None) -> RequestOutput:
        out = RequestOutput(seq.request_id, new, finished, reason, seq.num_prompt_tokens,
                            seq.num_cached_tokens, seq.num_imported_tokens,
                            len(seq.output_token_ids))
        if finished:
            admitted = seq.admitted_s if seq.admitted_s is not None else time.monotonic()
            out.queue_time_s = max(admitted - seq.added_s, 0.0)
            if seq.first_token_s is not None:
                out.prefill_time_s = max(seq.first_token_s - admitted, 0.0)
        return out

    def _forget(self, seq: Sequence) -> None:
        self._seqs.pop(seq.request_id, None)
        self._imports.pop(seq.request_id, None)
        self._importer.cancel(seq.request_id)  # mid-import: its host memory goes too
        self._generators.pop(seq.request_id, None)


def _grammar_prefix(matcher: Any, drafts: list[int]) -> list[int]:
    """The leading drafts ``matcher`` accepts without completing; the matcher is left as it
    was."""
    taken = 0
    for token in drafts:
        if matcher.is_terminated() or not _accepts(matcher, token):
            break
        taken += 1
        if matcher.is_terminated():  # the completing token is a row's own draw, not a draft
            matcher.rollback(1)
            taken -= 1
            break
    if taken:
        matcher.rollback(taken)
    return drafts[:taken]


def _accepts(matcher: Any, token: int) -> bool:
    """Whether ``matcher`` took ``token``; a matcher that raises has not."""
    try:
        return bool(matcher.accept_token(int(token)))
    except Exception:  # noqa: BLE001 - xgrammar's errors end that sequence, not the step
        return False
