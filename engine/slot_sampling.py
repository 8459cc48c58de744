"""Per-slot sampling state on the device: penalty counts, prompt masks, logit bias, min_tokens.

Every buffer is allocated once at start-up, one row per running slot (``max_batch`` rows), and
counted in the memory plan (``slot_sampling_bytes``). A sequence's row is written when it is
admitted (``admit``) and its token counts grow by one batched scatter per step (``record``);
``apply`` runs the penalties, the bias and the min_tokens mask over a whole step's logits as
batched tensor ops, with its [rows, vocab] scratch taken from the workspace. Nothing here
allocates device memory after start-up, and nothing here is sized by what a request asks for.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, SamplingParams
from engine.workspace import Workspace, _align

# columns of the per-slot scalar table
_PRESENCE, _FREQUENCY, _REPETITION, _HAS_STOPS = range(4)
_NUM_SCALARS = 4


def slot_sampling_bytes(max_batch: int, vocab_size: int) -> int:
    """Device bytes of the per-slot buffers (a term of the plan)."""
    per_slot = (vocab_size * (4 + 1)  # counts int32 + prompt mask bool
                + _NUM_SCALARS * 4 + MAX_LOGIT_BIAS * (8 + 4) + MAX_STOP_TOKEN_IDS * 8 + 4)
    return max_batch * per_slot


def apply_workspace_bytes(max_batch: int, vocab_size: int) -> int:
    """Workspace bytes ``apply`` takes for a step of ``max_batch`` rows."""
    n, v = max_batch, vocab_size
    return (_align(n * 8) + _align(n) + _align(n * _NUM_SCALARS * 4)
            + _align(n * v * 4) * 2 + _align(n * v) * 2  # counts, factor; two masks
            + _align(n * MAX_LOGIT_BIAS * 8) + _align(n * MAX_LOGIT_BIAS * 4)
            + _align(n * MAX_STOP_TOKEN_IDS * 8) + _align(n * MAX_STOP_TOKEN_IDS * 4))


class SlotSampling:
    """The device-side sampling state of ``max_batch`` slots."""

    def __init__(self, max_batch: int, vocab_size: int, device: torch.device,
                 stage_tokens: int) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.stage_tokens = stage_tokens  # most token ids staged through the workspace at once
        self.counts = torch.zeros(max_batch, vocab_size, dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros(max_batch, vocab_size, dtype=torch.bool, device=device)
        self.scalars = torch.zeros(max_batch, _NUM_SCALARS, dtype=torch.float32, device=device)
        self.bias_ids = torch.zeros(max_batch, MAX_LOGIT_BIAS, dtype=torch.int64, device=device)
        self.bias_values = torch.zeros(max_batch, MAX_LOGIT_BIAS, dtype=torch.float32,
                                       device=device)
        self.stop_ids = torch.zeros(max_batch, MAX_STOP_TOKEN_IDS, dtype=torch.int64,
                                    device=device)
        self.ones = torch.ones(max_batch, dtype=torch.int32, device=device)

    # -- admission ------------------------------------------------------------------------------
    def admit(self, slot: int, sp: SamplingParams, prompt: Sequence[int],
              output: Sequence[int], stop_ids: Sequence[int], ws: Workspace) -> None:
        """Write slot ``slot``'s row for a sequence with ``prompt`` and (after a preemption or
        a prefill elsewhere) ``output`` tokens so far. ``stop_ids``: the ids min_tokens holds
        back (stop ids and, unless ignore_eos, EOS)."""
        scal = torch.tensor([sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty,
                             1.0 if stop_ids else 0.0], dtype=torch.float32)
        self.scalars[slot].copy_(scal)
        bias_ids = torch.zeros(MAX_LOGIT_BIAS, dtype=torch.int64)
        bias_values = torch.zeros(MAX_LOGIT_BIAS, dtype=torch.float32)
        for i, (token, bias) in enumerate(sp.logit_bias):
            bias_ids[i], bias_values[i] = token, bias
        self.bias_ids[slot].copy_(bias_ids)
        self.bias_values[slot].copy_(bias_values)
        # Padding repeats the first id, so a scatter over the row writes one value per id.
        stops = list(stop_ids)[:MAX_STOP_TOKEN_IDS] or [0]
        stops += [stops[0]] * (MAX_STOP_TOKEN_IDS - len(stops))
        self.stop_ids[slot].copy_(torch.tensor(stops, dtype=torch.int64))
        self.counts[slot].zero_()
        self.prompt_mask[slot].zero_()
        if not sp.uses_counts:
            return
        self._scatter(slot, output, self.counts, accumulate=True, ws=ws)
        if sp.repetition_penalty != 1.0:
            self._scatter(slot, prompt, self.prompt_mask, accumulate=False, ws=ws)

    def _scatter(self, slot: int, ids: Sequence[int], into: torch.Tensor, accumulate: bool,
                 ws: Workspace) -> None:
        """Count (``accumulate``) or mark ``ids`` in ``into[slot]``, staged through the
        workspace in pieces of at most ``stage_tokens`` ids."""
        row = into[slot]
        for start in range(0, len(ids), self.stage_tokens):
            piece = torch.tensor(list(ids[start:start + self.stage_tokens]), dtype=torch.int64)
            with ws.scope():
                dev = ws.take((len(piece),), torch.int64, caller="slot_sampling.admit_ids")
                dev.copy_(piece)
                if accumulate:
                    ones = ws.take((len(piece),), torch.int32, caller="slot_sampling.admit_ones")
                    ones.fill_(1)
                    row.index_put_((dev,), ones, accumulate=True)
                else:
                    row.index_fill_(0, dev, True)

    # -- per step -------------------------------------------------------------------------------
    def apply(self, logits: torch.Tensor, slots: torch.Tensor, hold_stops: torch.Tensor,
              ws: Workspace, *, counts: bool, bias: bool, stops: bool,
              draft_counts: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Penalties, logit bias and the min_tokens mask, in place, for every row at once.

        logits: [n, vocab] fp32; slots: [n] int64 (each row's slot); hold_stops: [n] bool (the
        row is below its min_tokens). Rows whose slot has neutral values come out unchanged;
        the flags skip a stage no row of the step uses. ``draft_counts`` (a verify step,
        engine/spec_decode.py): (row, token) pairs [p] int64 each, counted on top of the slot's
        counts for that row only, so a row after draft tokens is penalised as if they were
        accepted."""
        n, vocab = logits.shape
        with ws.scope():
            if counts:
                self._penalties(logits, slots, ws, draft_counts)
            if bias:
                ids = ws.take((n, MAX_LOGIT_BIAS), torch.int64, caller="slot_sampling.bias_ids")
                vals = ws.take((n, MAX_LOGIT_BIAS), torch.float32,
                               caller="slot_sampling.bias_values")
                torch.index_select(self.bias_ids, 0, slots, out=ids)
                torch.index_select(self.bias_values, 0, slots, out=vals)
                logits.scatter_add_(1, ids, vals)
            if stops:
                ids = ws.take((n, MAX_STOP_TOKEN_IDS), torch.int64,
                              caller="slot_sampling.stop_ids")
                vals = ws.take((n, MAX_STOP_TOKEN_IDS), torch.float32,
                               caller="slot_sampling.stop_values")
                torch.index_select(self.stop_ids, 0, slots, out=ids)
                torch.gather(logits, 1, ids, out=vals)
                scal = ws.take((n, _NUM_SCALARS), torch.float32, caller="slot_sampling.scalars")
                torch.index_select(self.scalars, 0, slots, out=scal)
                hold = ws.take((n,), torch.bool, caller="slot_sampling.hold")
                torch.gt(scal[:, _HAS_STOPS], 0.5, out=hold)
                hold.logical_and_(hold_stops)
                vals.masked_fill_(hold.unsqueeze(1), float("-inf"))
                logits.scatter_(1, ids, vals)

    def _penalties(self, logits: torch.Tensor, slots: torch.Tensor, ws: Workspace,
                   draft_counts: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """vLLM's order: repetition (prompt and output tokens), then frequency and presence
        (output tokens only, as OpenAI defines them)."""
        n, vocab = logits.shape
        scal = ws.take((n, _NUM_SCALARS), torch.float32, caller="slot_sampling.scalars")
        torch.index_select(self.scalars, 0, slots, out=scal)
        cnt = ws.take((n, vocab), torch.int32, caller="slot_sampling.counts")
        torch.index_select(self.counts, 0, slots, out=cnt)
        if draft_counts is not None and draft_counts[0].numel():
            pair_rows, pair_tokens = draft_counts
            ones = ws.take((pair_rows.shape[0],), torch.int32, caller="slot_sampling.draft_ones")
            ones.fill_(1)
            cnt.index_put_((pair_rows, pair_tokens), ones, accumulate=True)
        factor = ws.take((n, vocab), torch.float32, caller="slot_sampling.factor")
        seen = ws.take((n, vocab), torch.bool, caller="slot_sampling.seen")
        mask = ws.take((n, vocab), torch.bool, caller="slot_sampling.mask")
        # repetition: a seen token's logit is divided by r when positive, multiplied when not
        rep = scal[:, _REPETITION : _REPETITION + 1]
        torch.index_select(self.prompt_mask, 0, slots, out=seen)
        torch.gt(cnt, 0, out=mask)
        seen.logical_or_(mask)
        torch.gt(logits, 0, out=mask)
        factor.copy_(mask)
        factor.mul_(rep.reciprocal() - rep).add_(rep)  # 1/r where positive, r elsewhere
        seen.logical_not_()
        factor.masked_fill_(seen, 1.0)
        logits.mul_(factor)
        # frequency: per occurrence; presence: once per generated token
        torch.mul(cnt, scal[:, _FREQUENCY : _FREQUENCY + 1], out=factor)
        logits.sub_(factor)
        torch.gt(cnt, 0, out=mask)
        factor.copy_(mask)
        factor.mul_(scal[:, _PRESENCE : _PRESENCE + 1])
        logits.sub_(factor)

    def record(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count each row's sampled token in its slot (one scatter for the step).
        slots, tokens: [n] int64 on the device; a slot may repeat (a verify step's accepted
        tokens), each pair counting once. At most ``max_batch`` pairs per call."""
        self.counts.index_put_((slots, tokens), self.ones[: slots.shape[0]], accumulate=True)
