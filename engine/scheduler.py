"""Decides what runs in the next step: chunked prefill and continuous batching of decodes.

Plain data in, plain data out: the scheduler sees token ids and block ids, never tensors, so it is
tested on a CPU with a fake pool. It never asks for memory outside the fixed block pool: when the
pool is dry it preempts the latest arrival (its KV is recomputed later), a planned and tested path.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int  # sequences running at once
    chunk_tokens: int  # tokens computed in one step, all sequences together
    max_context: int  # longest prompt + output a sequence may reach
    eos_token_ids: tuple[int, ...] = ()
    # the most context (tokens) the multi-token chunks of one step may reach together, where
    # the family's step gathers every chunk's history (e.g. compressed attention entries) and
    # its plan counts that gather for this many tokens; None: no limit. Prefix-cached sequences
    # share blocks, so the pool does not bound it by itself: the scheduler does
    max_step_context: int | None = None
    # a verify step that rejects a draft counts none of its positions as computed: the family
    # puts its per-sequence state back to the chunk's start (ModelFamily.restarts_rejected_verify)
    # and the sequence's next chunk recomputes the kept tokens
    restart_rejected_verify: bool = False

    def __post_init__(self) -> None:
        assert self.max_batch >= 1 and self.chunk_tokens >= 1 and self.max_context >= 2


@dataclass(frozen=True)
class ScheduledChunk:
    """``num_tokens`` tokens of one sequence starting at position ``start``."""

    request_id: str
    start: int
    num_tokens: int
    token_ids: tuple[int, ...]  # the tokens computed in this step
    block_ids: tuple[int, ...]  # the sequence's whole block table
    cache_slot: int
    do_sample: bool  # the chunk ends at the sequence's last token: sample the next one
    # the sequence's first chunk since it was admitted to its slot (it may start past 0: its
    # leading tokens came from the prefix cache or an import and are in its blocks already)
    is_first: bool = False
    # a verify step (engine/spec_decode.py): the last ``num_draft_tokens`` of ``token_ids``
    # are drafts after the sequence's last token; every one of its rows is sampled
    num_draft_tokens: int = 0

    @property
    def draft_token_ids(self) -> tuple[int, ...]:
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens:]

    @property
    def num_logits_rows(self) -> int:
        return self.num_draft_tokens + 1 if self.do_sample else 0

    @property
    def context_len(self) -> int:
        return self.start + self.num_tokens


@dataclass(frozen=True)
class KVLoad:
    """An admitted sequence whose leading KV the engine should import into its blocks before
    its first chunk is scheduled (engine/kv_import_job.py copies it, over one step or several;
    ``apply_kv_load`` ends it)."""

    request_id: str
    block_ids: tuple[int, ...]
    num_prompt_tokens: int
    num_computed_tokens: int  # already in its blocks (prefix cache): never overwritten
    max_tokens: int  # import at most this many leading tokens (one is always computed)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)  # given a cache slot in this step
    kv_loads: list[KVLoad] = field(default_factory=list)  # run before the chunks

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks and not self.kv_loads


@dataclass(frozen=True)
class SeqUpdate:
    """What one step did to a sequence, for the engine to report."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.blocks = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._free_slots = list(range(config.max_batch - 1, -1, -1))

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _context_fits(self, planned: list[tuple[Sequence, int]], seq: Sequence, n: int) -> bool:
        """Whether ``n`` tokens of ``seq`` keep the step's multi-token chunks within
        ``max_step_context`` (one-token rows gather nothing; the first chunk always fits, a
        sequence's context being within the pool)."""
        limit = self.config.max_step_context
        if limit is None or n <= 1:
            return True
        chunks = [s.num_computed_tokens + k for s, k in planned if k > 1]
        return not chunks or sum(chunks) + seq.num_computed_tokens + n <= limit

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.chunk_tokens
        planned: list[tuple[Sequence, int]] = []
        # Running sequences first, oldest first, so decodes are never starved by new prefills.
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or seq.is_importing:
                continue  # preempted in this loop, or its imported KV is not all in yet
            n = min(seq.num_uncomputed, budget)
            if not self._context_fits(planned, seq, n):
                continue  # its chunk waits for a step with less history to gather
            # a decode may verify its drafts too, as far as the step's budget goes (the engine
            # keeps them within max_tokens and max_context)
            d = min(len(seq.draft_token_ids), budget - 1) if seq.num_uncomputed == 1 else 0
            n += d
            while not self.blocks.append_slots(seq.block_ids, seq.num_computed_tokens + n):
                victim = max(self.running, key=lambda s: s.arrival)
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                planned = [(s, k) for s, k in planned if s is not victim]
                if victim is seq:
                    n = 0
                    break
            if n:
                planned.append((seq, n))
                budget -= n
                seq.num_scheduled_drafts = d
        while (self.waiting and budget > 0 and len(self.running) < self.config.max_batch
               and self._free_slots):
            seq = self.waiting[0]
            if not self._admit(seq):
                break
            self.waiting.popleft()
            out.admitted.append(seq.request_id)
            if seq.has_kv_import:  # load first; its chunks are scheduled once it is all in
                seq.is_importing = True
                out.kv_loads.append(KVLoad(
                    seq.request_id, tuple(seq.block_ids), seq.num_prompt_tokens,
                    seq.num_computed_tokens, min(seq.num_prompt_tokens, seq.num_tokens - 1)))
                continue
            n = min(seq.num_uncomputed, budget)
            if not self._context_fits(planned, seq, n):
                break  # admitted: its first chunk runs in a later step, and later arrivals wait
            planned.append((seq, n))
            budget -= n
        for seq, n in planned:
            start = seq.num_computed_tokens
            d, seq.num_scheduled_drafts = seq.num_scheduled_drafts, 0
            tokens = seq.token_slice(start, start + n - d) + seq.draft_token_ids[:d]
            out.chunks.append(ScheduledChunk(
                request_id=seq.request_id, start=start, num_tokens=n, token_ids=tuple(tokens),
                block_ids=tuple(seq.block_ids), cache_slot=seq.cache_slot,
                do_sample=start + n - d == seq.num_tokens, is_first=seq.is_fresh,
                num_draft_tokens=d,
            ))
            seq.is_fresh = False
        return out

    def apply_kv_load(self, request_id: str, num_loaded: int) -> None:
        """A KVLoad is over: the sequence's first ``num_loaded`` tokens are in its blocks (0:
        nothing usable came; it computes from what it had) and it may be scheduled again."""
        seq = next((s for s in self.running if s.request_id == request_id), None)
        if seq is None:
            return
        seq.is_importing = False
        if num_loaded <= seq.num_computed_tokens:
            return
        assert num_loaded < seq.num_tokens, "at least the last token must be computed"
        seq.num_imported_tokens = num_loaded
        seq.num_computed_tokens = num_loaded
        seq.num_cached_tokens = min(num_loaded, seq.num_prompt_tokens)

    def update_from_output(self, out: SchedulerOutput,
                           sampled: Mapping[str, int | Seq[int]]) -> list[SeqUpdate]:
        """Advance counters by what ran, append sampled tokens, finish what is done.
        ``sampled``: each sampling request's token, or (a verify step) its accepted drafts and
        one more token. Only the accepted drafts' KV counts as computed: the positions of
        rejected drafts are overwritten later and never registered in the prefix cache."""
        by_id = {s.request_id: s for s in self.running}
        updates = []
        for chunk in out.chunks:
            seq = by_id.get(chunk.request_id)
            if seq is None:  # aborted while the step ran
                continue
            got = sampled.get(chunk.request_id, ()) if chunk.do_sample else ()
            new = (got,) if isinstance(got, int) else tuple(got)
            if chunk.num_draft_tokens:
                accepted = max(len(new) - 1, 0)
                assert new[:accepted] == chunk.draft_token_ids[:accepted], "kept a non-draft"
                if not (self.config.restart_rejected_verify and accepted < chunk.num_draft_tokens):
                    seq.num_computed_tokens += chunk.num_tokens - chunk.num_draft_tokens + accepted
            else:
                seq.num_computed_tokens += chunk.num_tokens
            self.blocks.register_full_blocks(seq.block_ids, seq.block_hashes, seq.token_slice,
                                             seq.num_computed_tokens)
            if not chunk.do_sample:
                continue
            if seq.sampling.max_tokens == 0:  # the prompt was scored; nothing to generate
                self._finish(seq, "length")
                updates.append(SeqUpdate(seq.request_id, (), True, "length"))
                continue
            reason = None
            taken = 0
            for token in new:  # a token past a stop, max_tokens or max_context is dropped
                seq.output_token_ids.append(token)
                taken += 1
                reason = self.finish_reason(seq, token)
                if reason is not None:
                    break
            if reason is not None:
                self._finish(seq, reason)
            updates.append(SeqUpdate(seq.request_id, new[:taken], reason is not None, reason))
        return updates

    def abort(self, request_id: str) -> Sequence | None:
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = "abort"
                return seq
        for seq in self.running:
            if seq.request_id == request_id:
                self._finish(seq, "abort", keep_kv=False)
                return seq
        return None

    def finish(self, request_id: str, reason: str) -> Sequence | None:
        """End a running sequence now (its grammar is complete, or no token can be drawn for
        it); its blocks are kept only for a keep_kv sequence that ends well."""
        for seq in self.running:
            if seq.request_id == request_id:
                self._finish(seq, reason, keep_kv=None if reason != "error" else False)
                return seq
        return None

    def finish_reason(self, seq: Sequence, token: int) -> str | None:
        sp = seq.sampling
        if token in sp.stop_token_ids or (not sp.ignore_eos and token in self.config.eos_token_ids):
            return "stop"
        if len(seq.output_token_ids) >= sp.max_tokens or seq.num_tokens >= self.config.max_context:
            return "length"
        return None

    def _admit(self, seq: Sequence) -> bool:
        # Blocks for every token so far plus the one this sequence will sample next; at least the
        # last token is computed so there are logits to sample from.
        # A sequence that wants prompt logprobs takes no cached prefix: a cached block has KV
        # but no logits, so every prompt position is computed (its full blocks are still
        # registered for the next request).
        reusable = 0 if seq.wants_prompt_logprobs else seq.num_tokens - 1
        got = self.blocks.allocate(seq.token_ids(), seq.num_tokens + 1, reusable)
        if got is None:
            return False
        seq.block_ids, seq.num_computed_tokens = got
        seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
        seq.status = SequenceStatus.RUNNING
        seq.cache_slot = self._free_slots.pop()
        seq.is_fresh = True
        self.running.append(seq)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq, keep_kv=False)
        seq.num_scheduled_drafts = 0
        seq.status = SequenceStatus.WAITING
        seq.is_importing = False  # the engine cancels the import: it is recomputed
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _finish(self, seq: Sequence, reason: str, keep_kv: bool | None = None) -> None:
        self._release(seq, keep_kv=seq.keep_kv if keep_kv is None else keep_kv)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _release(self, seq: Sequence, keep_kv: bool) -> None:
        self.running.remove(seq)
        if not keep_kv:
            self.blocks.free(seq.block_ids)
            seq.block_ids = []
            seq.block_hashes = []
        assert seq.cache_slot not in self._free_slots, f"cache slot {seq.cache_slot} freed twice"
        self._free_slots.append(seq.cache_slot)
        seq.cache_slot = -1
