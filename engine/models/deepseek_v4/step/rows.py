"""The sequences of a step's flat batch (:class:`SeqSpan`) and how host addressing reaches the
device (:func:`to_device`). Plain data: no parameters, no cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SeqSpan:
    """One sequence of the step: tokens ``[begin, end)`` of the flat batch, its cache slot, and
    how many tokens the slot had absorbed before this step (= position of its first token)."""

    begin: int
    end: int
    slot: int
    start_pos: int
    table: torch.Tensor  # [blocks] int64: the sequence's block ids in the pool


def to_device(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A host tensor on ``dev`` without a stream sync: a copy from pageable memory waits for
    the device to finish its queue, which stalls a prefill chunk once per layer and sequence;
    from pinned memory it is queued like a kernel."""
    if dev.type != "cuda":
        return t.to(dev)
    return t.pin_memory().to(dev, non_blocking=True)
