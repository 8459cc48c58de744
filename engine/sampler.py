"""Turns logits into tokens: penalties, logit bias, min_tokens, then greedy or temperature /
top-k / top-p / min-p sampling with a generator per request, and the logprobs a request asked for.

Order, per step: a grammar's token bitmask (constrained rows only); the per-slot processors (``SlotSampling.apply``: repetition, frequency and
presence penalties, logit bias, min_tokens) run batched over all rows; logprobs are the
log-softmax of those processed logits (before temperature, top-k, top-p and min-p, which shape
how a token is drawn, not the model's distribution); then the greedy rows take one argmax and the
others are drawn row by row. Every vocab-sized buffer is a workspace view: sampling never
allocates vocab-sized tensors of its own.

Safe by construction: after the mask and the processors, a row whose largest logit is not a
finite number below ``MAX_SAFE_LOGIT`` (NaN, every token masked to -inf, an overflow) is not
drawn from. It gets an entry in ``SampleResult.errors`` and the engine ends that sequence alone;
every other row is sampled as usual. A row that passes has a finite maximum, so with the
temperature at or above its greedy floor the draw's softmax has a top probability of exactly 1
and cannot turn NaN.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.grammar import TokenBitmask, bitmask_workspace_bytes
from engine.sampling_params import MAX_LOGPROBS, SamplingParams
from engine.slot_sampling import SlotSampling, apply_workspace_bytes
from engine.workspace import Workspace, _align


@dataclass(frozen=True)
class TokenLogprobs:
    """The chosen token's logprob and the ``k`` most likely tokens (id, logprob), best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class SampleResult:
    tokens: list[int]
    logprobs: list[TokenLogprobs | None]  # per row; None where the row asked for none
    # row -> why no token could be drawn for it (its token in ``tokens`` is meaningless)
    errors: dict[int, str] = field(default_factory=dict)


# A row's largest logit must be below this: divided by the lowest non-greedy temperature (1e-5)
# it stays inside float32's range (3.4e38).
MAX_SAFE_LOGIT = 1e30


@dataclass(frozen=True)
class RowState:
    """What the sampler needs of a row beyond its SamplingParams."""

    slot: int  # the sequence's slot in SlotSampling
    num_output_tokens: int  # tokens generated so far (min_tokens)


def sampler_workspace_bytes(vocab_size: int, max_batch: int = 1) -> int:
    """Workspace bytes of one ``sample`` call over ``max_batch`` rows."""
    n, v = max_batch, vocab_size
    per_row_draw = 3 * 256 + v * (4 + 8 + 4 + 1)  # sorted values, order, probs, min-p mask
    logprobs = _align(n * v * 4) + 2 * _align(n * MAX_LOGPROBS * 8) + _align(n * 4)
    row_inputs = 3 * _align(n * 8) + _align(n)  # tokens, slots, chosen index; hold mask
    row_inputs += 2 * _align(n * 4) + _align(n)  # each row's peak logit, its size, usable
    return (per_row_draw + logprobs + row_inputs + apply_workspace_bytes(n, v)
            + _align(bitmask_workspace_bytes(n, v)))


def _stage(ws: Workspace, values: list, dtype: torch.dtype, caller: str) -> torch.Tensor:
    out = ws.take((len(values),), dtype, caller=caller)
    out.copy_(torch.tensor(values, dtype=dtype))
    return out


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None], ws: Workspace,
           rows: Sequence[RowState] | None = None,
           state: SlotSampling | None = None, bitmask: TokenBitmask | None = None,
           matchers: Sequence[Any | None] | None = None) -> SampleResult:
    """logits: [n, vocab] fp32 (modified in place) -> one token per row (and logprobs).
    ``rows``/``state`` carry the per-slot processors; without them only plain sampling runs.
    ``matchers`` (one per row, None for an unconstrained row) mask the logits first, through
    ``bitmask``: a grammar decides what may be sampled, the processors and the draw which."""
    n, vocab = logits.shape
    with ws.scope():
        errors: dict[int, str] = {}
        if matchers is not None:
            assert bitmask is not None
            errors.update(bitmask.apply(logits, matchers, ws))
        slots = None
        use_counts = False
        if state is not None and rows is not None and any(p.uses_processors for p in params):
            slots = _stage(ws, [r.slot for r in rows], torch.int64, "sampler.slots")
            hold = [r.num_output_tokens < p.min_tokens for r, p in zip(rows, params, strict=True)]
            hold_t = _stage(ws, hold, torch.bool, "sampler.hold_stops")
            use_counts = any(p.uses_counts for p in params)
            state.apply(logits, slots, hold_t, ws, counts=use_counts,
                        bias=any(p.logit_bias for p in params), stops=any(hold))
        check_rows(logits, ws, matchers, errors)
        want = [p.logprobs for p in params]
        lp, top_v, top_i = row_logprobs(logits, want, ws)
        tok = ws.take((n,), torch.int64, caller="sampler.tokens")
        torch.argmax(logits, dim=-1, out=tok)  # right for greedy rows; the others overwrite
        if not all(p.is_greedy or i in errors for i, p in enumerate(params)):
            _draw(logits, params, generators, ws, tok, skip=errors)
        if use_counts:
            assert state is not None and slots is not None
            state.record(slots, tok)
        tokens = [int(t) for t in tok.tolist()]
        if lp is None:
            return SampleResult(tokens, [None] * n, errors)
        chosen = lp.gather(1, tok.unsqueeze(1)).squeeze(1).tolist()
        tv = top_v.tolist() if top_v is not None else [[] for _ in range(n)]
        ti = top_i.tolist() if top_i is not None else [[] for _ in range(n)]
        out: list[TokenLogprobs | None] = []
        for i, w in enumerate(want):
            out.append(None if w is None else TokenLogprobs(
                tokens[i], float(chosen[i]),
                tuple((int(a), float(b)) for a, b in zip(ti[i][:w], tv[i][:w], strict=True))))
        return SampleResult(tokens, out, errors)


def check_rows(logits: torch.Tensor, ws: Workspace, matchers: Sequence[Any | None] | None,
                errors: dict[int, str]) -> None:
    """Find the rows no token can be drawn from (see the module docstring), record why in
    ``errors`` and make them harmless (all zeros) for the batched steps that follow."""
    n = logits.shape[0]
    peak = ws.take((n,), torch.float32, caller="sampler.row_peak")
    torch.amax(logits, dim=-1, out=peak)  # NaN anywhere in a row makes its peak NaN
    size = ws.take((n,), torch.float32, caller="sampler.row_peak_size")
    torch.abs(peak, out=size)
    usable = ws.take((n,), torch.bool, caller="sampler.row_usable")
    torch.lt(size, MAX_SAFE_LOGIT, out=usable)  # NaN < x is False
    if not errors and bool(usable.all()):  # the common case: one sync, nothing to do
        return
    for i, value in enumerate(peak.tolist()):
        if i not in errors and not abs(value) < MAX_SAFE_LOGIT:
            errors[i] = f"the sequence cannot continue: {_why(value, matchers, i)}"
    for i in errors:
        logits[i].fill_(0.0)


def _why(peak: float, matchers: Sequence[Any | None] | None, row: int) -> str:
    if peak != peak:
        return "its logits are NaN"
    if peak == float("-inf"):
        if matchers is not None and matchers[row] is not None:
            return ("no token is allowed next: its grammar (response_format or tools), together "
                    "with min_tokens, logit_bias and the stop tokens, admits none")
        return ("no token is allowed next: min_tokens, logit_bias and the stop tokens mask "
                "every token")
    return f"its logits are out of range (largest {peak:g})"


def _draw(logits: torch.Tensor, params: Sequence[SamplingParams],
          generators: Sequence[torch.Generator | None], ws: Workspace,
          tok: torch.Tensor, skip: Container[int] = ()) -> None:
    """Draw each non-greedy row's token into ``tok`` (temperature, top-k, top-p, min-p); rows
    in ``skip`` (no token can be drawn) are left as they are."""
    vocab = logits.shape[1]
    vals = ws.take((vocab,), torch.float32, caller="sampler.sorted_values")
    order = ws.take((vocab,), torch.int64, caller="sampler.sorted_indices")
    probs = ws.take((vocab,), torch.float32, caller="sampler.probs")
    small = ws.take((vocab,), torch.bool, caller="sampler.min_p_mask")
    for i, p in enumerate(params):
        if p.is_greedy or i in skip:
            continue
        row_probs(logits[i], p, vals, order, probs, small)
        choice = torch.multinomial(probs, 1, generator=generators[i])
        tok[i : i + 1].copy_(order.index_select(0, choice))


def row_probs(row: torch.Tensor, p: SamplingParams, vals: torch.Tensor, order: torch.Tensor,
              probs: torch.Tensor, small: torch.Tensor) -> None:
    """The distribution a non-greedy row draws from (temperature, top-k, min-p, top-p over the
    processed logits ``row`` [vocab], divided by the temperature in place): ``probs`` [vocab]
    over the tokens ``order`` [vocab] (sorted, most likely first), normalised. ``vals`` and
    ``small`` are scratch; every buffer is the caller's."""
    vocab = row.shape[0]
    row.div_(p.temperature)
    torch.sort(row, descending=True, out=(vals, order))
    keep = vocab
    if p.top_k > 0:
        keep = min(keep, p.top_k)
    # softmax over the sorted row (stable: subtract the max)
    torch.sub(vals, vals[0], out=probs)
    probs.exp_()
    probs[keep:] = 0
    if p.min_p > 0.0:
        # probs[0] is the top token's (unnormalised) mass: drop what is below min_p of it
        torch.lt(probs, probs[0] * p.min_p, out=small)
        probs.masked_fill_(small, 0.0)
    probs.div_(probs.sum())
    if p.top_p < 1.0:
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        torch.cumsum(probs, dim=0, out=vals)
        cut = int(torch.searchsorted(vals, torch.tensor(p.top_p, device=vals.device)))
        probs[cut + 1 :] = 0
        probs.div_(probs.sum())


def row_logprobs(logits: torch.Tensor, want: list[int | None], ws: Workspace
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Log-probabilities of every row of ``logits`` (rows x vocab) and the top ``max(want)`` of
    each, in the workspace; (None, None, None) when no row asked for logprobs (``want`` holds
    each row's top_logprobs count, None for no logprobs)."""
    if all(w is None for w in want):
        return None, None, None
    n, vocab = logits.shape
    lp = ws.take((n, vocab), torch.float32, caller="sampler.logprobs")
    lp.copy_(logits)
    lp.sub_(torch.logsumexp(logits, dim=-1, keepdim=True))
    k = max(w for w in want if w is not None)
    if k == 0:
        return lp, None, None
    top_v = ws.take((n, k), torch.float32, caller="sampler.top_logprobs")
    top_i = ws.take((n, k), torch.int64, caller="sampler.top_ids")
    torch.topk(lp, k, dim=-1, out=(top_v, top_i))
    return lp, top_v, top_i
