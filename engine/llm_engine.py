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
from engine.engine_loading import export_if_owned, load_rank0, non_torch_bytes, start_other_ranks
from engine.errors import (
    DuplicateRequest,
    EngineError,
    QueueFull,
    SequenceFailed,
    StepFailed,
)
from engine.grammar import advance_matchers, new_matcher
from engine.kv_import_job import KVImporter
from engine.kv_layout import KVLayout
from engine.memory_planner import plan_engine
from engine.model_config import ModelConfig
from engine.model_runner import KVImport, ModelRunner
from engine.models.family import family_class
from engine.outputs import EngineStats, RequestOutput, request_output
from engine.request_checks import check_request
from engine.sampler import RowState
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import Sequence, SequenceStatus
from engine.spec_drafts import SpecDrafts, check_speculation
from engine.staged_kv import StagedKV
from engine.step_isolation import StepIsolator
from engine.warmup import Warmup, warm_up
from engine.weight_share import SharedWeights, load_or_map

log = logging.getLogger(__name__)


class LLMEngine:
    """Requests in (``add_request``), one scheduler step of outputs out (``step``); the model
    runs in ``runner`` (engine/model_runner.py), the step's plan comes from ``scheduler``."""

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
        check_speculation(ec, family, model_config.family)
        # quantized payloads count as the model will hold them (stored, or dequantized); one-box
        # mode: the arena, owned here or mapped from another process
        weight_bytes, mapped = ((family.resident_weight_bytes(weights, ec), 0) if shared is None
                                else (shared.nbytes, 0) if shared.owned else (0, shared.nbytes))
        ec, self.plan = plan_engine(model_config, rank_cfg, ec, weight_bytes, non_torch_bytes,
                                    mapped)
        self.plan.check()
        self.config = ec
        self.model_config = model_config
        if progress is not None:
            progress(f"memory plan: {self.plan.summary()}")
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
        self.warmup_report = warm_up(self.runner, ec, model_fingerprint, ranks is None, progress)
        self._seqs: dict[str, Sequence] = {}
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
        self._spec = None if not ec.spec_tokens else SpecDrafts(
            ec, None if ec.speculative_method == "ngram" else
            lambda wanted: self.runner.model.propose_drafts(self.runner.kv, wanted))

    @classmethod
    def from_config(cls, ec: EngineConfig,
                    progress: Callable[[str], None] | None = None) -> LLMEngine:
        """Load (or, in one-box mode, map), plan, allocate, warm up and lock
        (engine/engine_loading.py)."""
        if ec.share_weights:  # one-box mode: load and export the weights, or map an export
            got = load_or_map(ec, progress)
            engine = cls(ec, got.config, got.weights, got.model_fingerprint, got.non_torch_bytes,
                         progress, shared=got.shared)
            export_if_owned(got, ec, progress)
            return engine
        ranks = None
        try:
            ec, ranks = start_other_ranks(ec, progress)  # they load their own slices meanwhile
            non_torch = non_torch_bytes(ec)
            ckpt = load_rank0(ec, progress)
            return cls(ec, ckpt.config, ckpt.state_dict, ckpt.model_fingerprint, non_torch,
                       progress, ranks=ranks)
        except BaseException:
            if ranks is not None:
                ranks.abort()
            raise

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
        check_request(ec, self.model_config.vocab_size, prompt, sampling)
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
            self._importer.add(request_id, kv_import)
        if first_token_id is not None:
            seq.external_first_token = True
            seq.output_token_ids.append(int(first_token_id))
            reason = self.scheduler.finish_reason(seq, int(first_token_id))
            if reason is not None:
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = reason
                self._pending.append(request_output(seq, [], True, reason))
                self._forget(seq)
                return
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return self.release(request_id)
        self._pending.append(request_output(seq, [], True, "abort"))
        self._forget(seq)
        return True

    def recapture_graphs(self, progress: Callable[[str], None] | None = None) -> None:
        """Capture the decode graphs again (after a change to a model option that a step reads,
        for a benchmark's A/B on the same weights; ``Warmup.recapture_graphs``). Only while
        no block is in use; the cached prefixes are forgotten, since the warm-up's re-run
        writes over free blocks."""
        if self.has_unfinished() or self._importer.num_waiting:
            raise EngineError("recapture_graphs: requests are still running or importing")
        try:
            self.block_manager.forget_cached_prefixes()
        except RuntimeError as e:
            raise EngineError(f"recapture_graphs: {e}") from None
        Warmup(self.runner).recapture_graphs(progress)
        self.warmup_report = dataclasses.replace(
            self.warmup_report, device_allocs_after_warmup=self.runner.allocs_after_warmup)

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
        if self._spec is not None:
            self._spec.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        self._preemptions += len(sched.preempted)
        for rid in sched.preempted:
            gen = self._generators.pop(rid, None)
            seq = self._seqs.get(rid)
            if gen is not None and seq is not None:
                seq.rng_state = gen.get_state()
            if seq is not None and seq.has_kv_import:  # it recomputes: its import goes
                seq.has_kv_import = False
                self._importer.cancel(rid)
        for rid in sched.admitted:
            self._on_admit(self._seqs[rid])
        for rid in self._importer.start_loads(sched.kv_loads):
            self.scheduler.apply_kv_load(rid, 0)
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
        done_now = advance_matchers(matchers, sampled, failed)  # their grammar completed
        if self._spec is not None:
            self._spec.count(sched.chunks, sampled, failed)
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
            out = request_output(seq, list(u.new_token_ids), finished, reason)
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

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            free_kv_tokens=self.block_manager.num_free_blocks * self.config.block_size,
            steps_completed=self._steps, tokens_advanced=self._tokens,
            num_preemptions=self._preemptions,
            device_allocs_since_warmup=self.runner.device_allocs_since_warmup,
            **({} if self._spec is None else dict(
                spec_num_drafts=self._spec.num_drafts,
                spec_num_draft_tokens=self._spec.num_draft_tokens,
                spec_num_accepted_tokens=self._spec.num_accepted,
                spec_accepted_per_pos=tuple(self._spec.accepted_per_pos))))

    # -- internals ------------------------------------------------------------------------------
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
        if self._spec is not None:
            self._spec.reset(seq.cache_slot)
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
        out = request_output(seq, [], True, reason)
        out.error = error
        if seq.keep_kv and error is None:
            self._kept[seq.request_id] = seq
        self._forget(seq)
        return out

    def _forget(self, seq: Sequence) -> None:
        self._seqs.pop(seq.request_id, None)
        self._importer.cancel(seq.request_id)  # mid-import: its host memory goes too
        self._generators.pop(seq.request_id, None)
