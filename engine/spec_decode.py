"""Verifying draft tokens: one step's logits rows for every sequence's last token and its drafts
become the tokens that sequence keeps (the accepted drafts and one more).

Each sequence with ``d`` drafts owns ``d + 1`` consecutive rows; row ``j`` holds the model's
logits after the sequence's tokens and drafts ``1..j``. Every row is processed as the plain
sampler would process it had drafts ``1..j`` been accepted: the grammar mask of the matcher
advanced over them, penalties counting them, min_tokens counting them. That processed
distribution is the target ``p_j``.

- Greedy: keep draft ``j + 1`` while it is row ``j``'s argmax; the first row that disagrees (or
  row ``d``) gives its argmax. The output is token for token what plain greedy decoding gives
  on the same logits; the verify forward computes ``d + 1`` positions in one matmul, whose
  float sums may round differently from a one-position step's, so at a near-tie of the top two
  logits the argmax can differ (as with any change of batch shape).
- Sampling: the n-gram drafter proposes one token, a point mass ``q = 1[d]``. Rejection
  sampling accepts ``d`` with probability ``min(1, p(d) / q(d)) = p(d)``; on rejection the
  next token is drawn from the residual ``max(p - q, 0)`` normalised, which is ``p`` with ``d``
  removed. Each kept token is then distributed exactly as ``p_j`` (Leviathan et al. 2023); the
  bonus row ``d`` draws from ``p_d`` when all drafts are kept. ``p`` is the distribution
  ``engine/sampler.py`` draws from: processed logits, then temperature, top-k, min-p, top-p.

Logprobs of a kept token are its row's log-softmax of the processed logits, as without
drafts. Every buffer is a workspace view; nothing here allocates vocab-sized memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.grammar import TokenBitmask, apply_bitmask
from engine.sampler import (
    RowState,
    TokenLogprobs,
    check_rows,
    row_logprobs,
    row_probs,
)
from engine.sampling_params import MAX_LOGPROBS, SamplingParams
from engine.slot_sampling import SlotSampling
from engine.workspace import Workspace, _align


def spec_decode_workspace_bytes(vocab_size: int, max_batch: int, k: int) -> int:
    """Workspace bytes a verify step takes beyond the sampler's own rows: the draft count pairs
    of the penalties (``k (k + 1) / 2`` per sequence: row ``j`` counts drafts ``1..j``), the
    target distribution over the vocabulary in token order, a uniform draw, the kept tokens
    with their slots and their logprobs."""
    if k == 0:
        return 0
    rows = max_batch * (k + 1)
    pairs = max_batch * k * (k + 1) // 2
    return (2 * _align(pairs * 8) + _align(pairs * 4) + _align(vocab_size * 4) + _align(4)
            + 2 * _align(rows * 8) + _align(rows * 8) + _align(rows * 4))


@dataclass(frozen=True)
class VerifyResult:
    tokens: list[list[int]]  # per sequence: the kept drafts and one more token
    logprobs: list[list[TokenLogprobs] | None]  # per sequence, one per kept token
    errors: dict[int, str] = field(default_factory=dict)  # sequence -> why no token came


def verify(logits: torch.Tensor, params: Sequence[SamplingParams],
           drafts: Sequence[Sequence[int]], generators: Sequence[torch.Generator | None],
           ws: Workspace, rows: Sequence[RowState], state: SlotSampling,
           bitmask: TokenBitmask, matchers: Sequence[Any | None] | None = None) -> VerifyResult:
    """logits: [sum(len(drafts[i]) + 1), vocab] fp32 (modified in place), sequence ``i``'s
    rows in order; ``rows[i]`` its slot and tokens so far; ``matchers[i]`` its grammar
    matcher at its current state (left there: the caller advances it over the kept tokens)."""
    n, vocab = logits.shape
    first = [0]
    for d in drafts:
        first.append(first[-1] + len(d) + 1)
    assert first[-1] == n, f"{n} logits rows for {first[-1]} verify rows"
    row_seq = [i for i, d in enumerate(drafts) for _ in range(len(d) + 1)]
    row_pos = [j for d in drafts for j in range(len(d) + 1)]
    row_params = [params[i] for i in row_seq]
    with ws.scope():
        row_errors: dict[int, str] = {}
        row_matchers = None
        if matchers is not None:  # all None (the warm-up): every row's mask is all ones
            row_matchers = [matchers[i] for i in row_seq]
            row_errors.update(_mask_rows(logits, matchers, drafts, first, bitmask, ws))
        slots_t = None
        use_counts = any(p.uses_counts for p in params)
        if any(p.uses_processors for p in params):
            slots_t = _stage(ws, [rows[i].slot for i in row_seq], torch.int64, "spec.slots")
            hold = [rows[i].num_output_tokens + j < row_params[r].min_tokens
                    for r, (i, j) in enumerate(zip(row_seq, row_pos, strict=True))]
            hold_t = _stage(ws, hold, torch.bool, "spec.hold_stops")
            pairs = [(first[i] + j, d[t]) for i, d in enumerate(drafts)
                     for j in range(1, len(d) + 1) for t in range(j)] if use_counts else []
            draft_counts = None
            if pairs:
                draft_counts = (_stage(ws, [r for r, _ in pairs], torch.int64, "spec.pair_rows"),
                                _stage(ws, [t for _, t in pairs], torch.int64,
                                       "spec.pair_tokens"))
            state.apply(logits, slots_t, hold_t, ws, counts=use_counts,
                        bias=any(p.logit_bias for p in params), stops=any(hold),
                        draft_counts=draft_counts)
        check_rows(logits, ws, row_matchers, row_errors)
        want = [p.logprobs for p in params]
        lp, top_v, top_i = row_logprobs(logits, want, ws)
        best = ws.take((n,), torch.int64, caller="sampler.tokens")
        torch.argmax(logits, dim=-1, out=best)
        argmax = best.tolist()
        scratch = _Scratch(ws, vocab, logits.device)
        tokens: list[list[int]] = []
        errors: dict[int, str] = {}
        for i, (p, d) in enumerate(zip(params, drafts, strict=True)):
            kept, why = _accept(logits, first[i], p, d, argmax, generators[i], row_errors,
                                scratch)
            tokens.append(kept)
            if why is not None:
                errors[i] = why
        out_rows = [first[i] + j for i, kept in enumerate(tokens) if i not in errors
                    for j in range(len(kept))]
        out_tokens = [t for i, kept in enumerate(tokens) if i not in errors for t in kept]
        if use_counts and out_rows:
            _record(state, ws, [rows[row_seq[r]].slot for r in out_rows], out_tokens)
        logprobs: list[list[TokenLogprobs] | None] = [None] * len(params)
        if lp is not None:
            _logprobs(lp, top_v, top_i, want, tokens, first, errors, logprobs, ws)
        return VerifyResult(tokens, logprobs, errors)


class _Scratch:
    """The per-row buffers of the sampling draws, taken once per verify step."""

    def __init__(self, ws: Workspace, vocab: int, device: torch.device) -> None:
        self.vals = ws.take((vocab,), torch.float32, caller="sampler.sorted_values")
        self.order = ws.take((vocab,), torch.int64, caller="sampler.sorted_indices")
        self.probs = ws.take((vocab,), torch.float32, caller="sampler.probs")
        self.small = ws.take((vocab,), torch.bool, caller="sampler.min_p_mask")
        self.target = ws.take((vocab,), torch.float32, caller="spec.target_probs")
        self.uniform = ws.take((1,), torch.float32, caller="spec.uniform")


def _accept(logits: torch.Tensor, first: int, p: SamplingParams, drafts: Sequence[int],
            argmax: list[int], gen: torch.Generator | None, row_errors: dict[int, str],
            s: _Scratch) -> tuple[list[int], str | None]:
    """One sequence's kept tokens (the accepted drafts and one more), or why it stopped."""
    kept: list[int] = []
    for j in range(len(drafts) + 1):
        row = first + j
        if row in row_errors:
            return kept, row_errors[row]
        draft = drafts[j] if j < len(drafts) else None
        if p.is_greedy:
            if draft is not None and argmax[row] == draft:
                kept.append(draft)
                continue
            kept.append(argmax[row])
            return kept, None
        row_probs(logits[row], p, s.vals, s.order, s.probs, s.small)
        s.target.zero_()
        s.target.scatter_(0, s.order, s.probs)  # p over token ids
        if draft is not None:
            s.uniform.uniform_(generator=gen)
            if bool(s.uniform[0] < s.target[draft]):  # accepted with probability p(draft)
                kept.append(draft)
                continue
            s.target[draft] = 0.0  # the residual max(p - 1[draft], 0), renormalised below
            s.target.div_(s.target.sum())
        kept.append(int(torch.multinomial(s.target, 1, generator=gen)))
        return kept, None
    raise AssertionError("unreachable: the last row always yields a token")


def _mask_rows(logits: torch.Tensor, matchers: Sequence[Any | None],
               drafts: Sequence[Sequence[int]], first: list[int], bitmask: TokenBitmask,
               ws: Workspace) -> dict[int, str]:
    """Fill each row's grammar bitmask with its matcher advanced over the drafts before it
    (then rolled back), and mask the logits. -> row: why, for rows with no next token."""
    failed: dict[int, str] = {}
    host = bitmask.host
    for i, m in enumerate(matchers):
        for j in range(len(drafts[i]) + 1):
            row = first[i] + j
            if m is None:
                host[row].fill_(-1)
                continue
            try:
                if m.is_terminated():
                    failed[row] = "its grammar is already complete: no token may follow"
                else:
                    m.fill_next_token_bitmask(host, row)
            except Exception as exc:  # noqa: BLE001 - a matcher's failure is its sequence's
                failed[row] = f"its grammar cannot give the next tokens ({exc})"
            if row in failed:
                host[row].fill_(0)
            if j < len(drafts[i]) and not m.accept_token(int(drafts[i][j])):
                # the engine cut drafts to what the grammar accepts; this should never happen
                failed[row + 1] = f"its grammar refused draft token {drafts[i][j]}"
                for rest in range(row + 1, first[i + 1]):
                    host[rest].fill_(0)
                m.rollback(j)
                break
        else:
            if m is not None and drafts[i]:
                m.rollback(len(drafts[i]))
    n = logits.shape[0]
    dev = ws.take((n, bitmask.words), torch.int32, caller="grammar.bitmask")
    dev.copy_(host[:n], non_blocking=True)
    apply_bitmask(logits, dev, bitmask.shifts, ws)
    return {r: f"the sequence cannot continue: {why}" for r, why in failed.items()}


def _stage(ws: Workspace, values: list, dtype: torch.dtype, caller: str) -> torch.Tensor:
    out = ws.take((len(values),), dtype, caller=caller)
    out.copy_(torch.tensor(values, dtype=dtype))
    return out


def _record(state: SlotSampling, ws: Workspace, slots: list[int], tokens: list[int]) -> None:
    """Count the kept tokens in their slots' penalty counts (``record`` takes at most
    ``max_batch`` pairs a call: its ones are one per slot)."""
    step = state.ones.shape[0]
    for start in range(0, len(slots), step):
        with ws.scope():
            s = _stage(ws, slots[start:start + step], torch.int64, "spec.accepted_slots")
            t = _stage(ws, tokens[start:start + step], torch.int64, "spec.accepted_tokens")
            state.record(s, t)


def _logprobs(lp: torch.Tensor, top_v: torch.Tensor | None, top_i: torch.Tensor | None,
              want: list[int | None], tokens: list[list[int]], first: list[int],
              errors: dict[int, str], out: list[list[TokenLogprobs] | None],
              ws: Workspace) -> None:
    vocab = lp.shape[1]
    picks = [(i, first[i] + j, t) for i, kept in enumerate(tokens)
             if want[i] is not None and i not in errors for j, t in enumerate(kept)]
    if not picks:
        return
    flat = _stage(ws, [r * vocab + t for _, r, t in picks], torch.int64, "spec.logprob_index")
    chosen_t = ws.take((len(picks),), torch.float32, caller="spec.chosen_logprobs")
    torch.take(lp, flat, out=chosen_t)
    chosen = chosen_t.tolist()
    tv = top_v.tolist() if top_v is not None else None
    ti = top_i.tolist() if top_i is not None else None
    for (i, r, t), c in zip(picks, chosen, strict=True):
        w = want[i]
        assert w is not None and w <= MAX_LOGPROBS
        top = () if tv is None or ti is None else tuple(
            (int(a), float(b)) for a, b in zip(ti[r][:w], tv[r][:w], strict=True))
        items = out[i]
        if items is None:
            items = out[i] = []
        items.append(TokenLogprobs(t, float(c), top))
