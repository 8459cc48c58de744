"""Prompt logprobs: the log-softmax of the model's logits at every prompt position of a chunk,
for requests that ask for them (completions ``echo`` with ``logprobs``; lm-eval's loglikelihood).

The logits of a whole chunk would be ``chunk_tokens x vocab`` fp32 (2.5 GB at 4096 x 152k), so
the chunk's hidden rows go through the LM head ``max_batch`` rows at a time, into one reused
``[rows, vocab]`` workspace buffer: the same shape as a full decode batch's logits, so the
transient tensors of ``compute_logits`` are the ones the plan already counts for a decode step.
Of each row only the scored token's logprob and the top ``MAX_PROMPT_LOGPROBS`` survive, in
``[chunk_tokens]``-bounded workspace buffers; they reach the host once per chunk.

The values are the raw model distribution (no penalties, bias or temperature), as vLLM's
``prompt_logprobs``. Never allocates a vocab-sized tensor of its own and never sizes a buffer by
what a request asks for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.sampler import TokenLogprobs
from engine.sampling_params import MAX_PROMPT_LOGPROBS
from engine.workspace import Workspace, _align


def prompt_logprob_rows(chunk_tokens: int, max_batch: int) -> int:
    """Rows scored per LM-head pass: a decode batch's worth, never more than a chunk."""
    return max(1, min(chunk_tokens, max_batch))


def prompt_logprobs_workspace_bytes(vocab_size: int, chunk_tokens: int, max_batch: int) -> int:
    """Workspace of one step's prompt scoring: the reused logits rows and their log-sum-exp,
    and per chunk token the target id, the chosen logprob and the top-k values and ids."""
    rows = prompt_logprob_rows(chunk_tokens, max_batch)
    k, c = MAX_PROMPT_LOGPROBS, chunk_tokens
    return (_align(rows * vocab_size * 4) + _align(rows * 4) + _align(c * 8) + _align(c * 4)
            + _align(c * k * 4) + _align(c * k * 8))


@dataclass(frozen=True)
class PromptSpan:
    """Which rows of a step's hidden states score which prompt tokens: hidden row
    ``first_row + j`` (position ``start + j``) predicts prompt token ``start + j + 1``."""

    request_id: str
    first_row: int
    start: int  # prompt position of the first scored row
    targets: tuple[int, ...]  # the prompt tokens the rows predict
    k: int  # top alternatives the request asked for, <= MAX_PROMPT_LOGPROBS


def prompt_span(request_id: str, first_row: int, start: int, num_tokens: int,
                prompt: Sequence[int], k: int) -> PromptSpan | None:
    """The span of a chunk at ``start`` with ``num_tokens`` tokens, or None when it scores no
    prompt token (its rows are all at or past the prompt's last position)."""
    end = min(start + num_tokens, len(prompt) - 1)
    if end <= start:
        return None
    return PromptSpan(request_id, first_row, start, tuple(prompt[start + 1 : end + 1]), k)


def score_prompt_spans(hidden: torch.Tensor, spans: Sequence[PromptSpan], rows: int,
                       vocab_size: int,
                       compute_logits: Callable[[torch.Tensor, torch.Tensor], object],
                       ws: Workspace) -> dict[str, list[TokenLogprobs]]:
    """hidden: [num_tokens, hidden] of the step -> each span's TokenLogprobs, one per target.

    ``rows`` hidden rows at a time through ``compute_logits(hidden [m, h], out [m, vocab])``;
    the top ``MAX_PROMPT_LOGPROBS`` are always computed (one shape for every request) and cut to
    each span's ``k`` on the host."""
    total = sum(len(s.targets) for s in spans)
    if total == 0:
        return {}
    k = MAX_PROMPT_LOGPROBS
    assert vocab_size >= k, f"a vocabulary of {vocab_size} has no top {k}"
    with ws.scope():
        logits = ws.take((rows, vocab_size), torch.float32, caller="prompt_logprobs.logits")
        lse = ws.take((rows,), torch.float32, caller="prompt_logprobs.lse")
        targets = ws.take((total,), torch.int64, caller="prompt_logprobs.targets")
        chosen = ws.take((total,), torch.float32, caller="prompt_logprobs.chosen")
        top_v = ws.take((total, k), torch.float32, caller="prompt_logprobs.top_values")
        top_i = ws.take((total, k), torch.int64, caller="prompt_logprobs.top_ids")
        targets.copy_(torch.tensor([t for s in spans for t in s.targets], dtype=torch.int64))
        done = 0
        for s in spans:
            for a in range(0, len(s.targets), rows):
                m = min(rows, len(s.targets) - a)
                lg, o = logits[:m], slice(done + a, done + a + m)
                compute_logits(hidden[s.first_row + a : s.first_row + a + m], lg)
                torch.logsumexp(lg, dim=-1, out=lse[:m])
                torch.gather(lg, 1, targets[o].unsqueeze(1), out=chosen[o].unsqueeze(1))
                chosen[o].sub_(lse[:m])
                torch.topk(lg, k, dim=-1, out=(top_v[o], top_i[o]))
                top_v[o].sub_(lse[:m].unsqueeze(1))
            done += len(s.targets)
        chosen_h, top_vh, top_ih = chosen.tolist(), top_v.tolist(), top_i.tolist()
    result: dict[str, list[TokenLogprobs]] = {}
    row = 0
    for s in spans:
        result[s.request_id] = [
            TokenLogprobs(t, float(chosen_h[row + j]), tuple(
                (int(i), float(v))
                for i, v in zip(top_ih[row + j][: s.k], top_vh[row + j][: s.k], strict=True)))
            for j, t in enumerate(s.targets)]
        row += len(s.targets)
    return result
