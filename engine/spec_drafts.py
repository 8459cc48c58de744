"""The engine's side of speculative decoding: each running decode's drafts for the next step
(n-gram: engine/ngram_drafter.py; mtp: the family's draft layers), cut to what its request,
the context and its grammar allow, and the counters of what the verify steps accepted (vLLM's
spec_decode counters).

Plain bookkeeping over sequences; the verify step itself is engine/spec_decode.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from engine.config import EngineConfig
from engine.errors import PlanError
from engine.grammar import accepts
from engine.ngram_drafter import NgramDrafter
from engine.scheduler import ScheduledChunk
from engine.sequence import Sequence

ModelDrafts = Callable[[list[tuple[int, int, int, int, list[int]]]], list[list[int]]]


def check_speculation(ec: EngineConfig, family: Any, family_name: str) -> None:
    """Refuse a speculative method the family cannot serve (PlanError naming the setting)."""
    if not ec.spec_tokens:
        return
    if family.speculation_problem is not None:
        raise PlanError(f"speculative_method={ec.speculative_method}: family {family_name} "
                        f"cannot verify drafts: {family.speculation_problem}; serve it with "
                        "speculative_method none")
    if ec.speculative_method not in family.speculative_methods:
        raise PlanError(f"speculative_method={ec.speculative_method}: family {family_name} "
                        f"drafts with {', '.join(family.speculative_methods)} only (mtp needs "
                        "a family with multi-token-prediction layers); use one of those or none")


class SpecDrafts:
    def __init__(self, ec: EngineConfig, model_drafts: ModelDrafts | None = None) -> None:
        """``model_drafts`` (mtp): the family's draft layers, all decodes in one call, given
        per decode (cache slot, last token, its position, k, block ids)."""
        self.ec = ec
        self.drafter = (NgramDrafter(ec.max_batch, ec.max_context)
                        if ec.speculative_method == "ngram" else None)
        self.model_drafts = model_drafts
        if self.drafter is None and model_drafts is None:
            raise ValueError(f"speculative_method={ec.speculative_method}: no drafter")
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted = 0
        self.accepted_per_pos = [0] * ec.spec_tokens

    def reset(self, slot: int) -> None:
        """A sequence was admitted to ``slot``: forget the previous one's n-grams."""
        if self.drafter is not None:
            self.drafter.reset(slot)

    def propose(self, running: Iterable[Sequence]) -> None:
        """Each running decode's drafts for this step, at most its request's number, cut so
        that its output stays within max_tokens and max_context, and to what its grammar
        accepts (a draft that would complete the grammar is cut too: the token that completes
        it is always a row's own draw)."""
        ec = self.ec
        wanted: list[tuple[Sequence, int]] = []
        for seq in running:
            seq.draft_token_ids = []
            if seq.is_importing or seq.num_uncomputed != 1:
                continue
            sp = seq.sampling
            k = ec.spec_tokens if sp.num_speculative_tokens is None else sp.num_speculative_tokens
            k = min(k, sp.max_tokens - len(seq.output_token_ids) - 1,
                    ec.max_context - seq.num_tokens)
            if k > 0:
                wanted.append((seq, k))
        if not wanted:
            return
        if self.drafter is not None:
            proposed = []
            for seq, k in wanted:
                self.drafter.sync(seq.cache_slot, seq)
                proposed.append(self.drafter.propose(seq.cache_slot, k))
        else:
            assert self.model_drafts is not None
            proposed = self.model_drafts([
                (seq.cache_slot, seq.token_slice(seq.num_tokens - 1, seq.num_tokens)[0],
                 seq.num_tokens - 1, k, list(seq.block_ids)) for seq, k in wanted])
        for (seq, _k), drafts in zip(wanted, proposed, strict=True):
            if drafts and seq.matcher is not None:
                drafts = grammar_prefix(seq.matcher, drafts)
            seq.draft_token_ids = drafts

    def count(self, chunks: Iterable[ScheduledChunk], sampled: Mapping[str, list[int]],
              failed: Mapping[str, str]) -> None:
        """A verify step's outcome: of each chunk's drafts, those accepted (its tokens less
        the one drawn after them)."""
        for c in chunks:
            if not c.num_draft_tokens or c.request_id in failed:
                continue
            accepted = len(sampled.get(c.request_id, ())) - 1
            self.num_drafts += 1
            self.num_draft_tokens += c.num_draft_tokens
            self.num_accepted += accepted
            for i in range(accepted):
                self.accepted_per_pos[i] += 1


def grammar_prefix(matcher: Any, drafts: list[int]) -> list[int]:
    """The leading drafts ``matcher`` accepts without completing; the matcher is left as it
    was."""
    taken = 0
    for token in drafts:
        if matcher.is_terminated() or not accepts(matcher, token):
            break
        taken += 1
        if matcher.is_terminated():  # the completing token is a row's own draw, not a draft
            matcher.rollback(1)
            taken -= 1
            break
    if taken:
        matcher.rollback(taken)
    return drafts[:taken]
