"""The addressing of a DeepSeek-V4 decode step, one row per one-token sequence
(:class:`DecodeRows`), and where a mixed step's one-token rows sit in its flat batch
(:class:`DecodeSpans`). Device tensors prepared once per step and shared by every layer; plain
data: no parameters, no cache, no host reads of device values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch


@dataclass(frozen=True)
class DecodeRows:
    """The step's addressing, one row per sequence: its cache slot, the position of its token
    (= tokens its slot held before the step) and its block table (null-padded)."""

    slots: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    tables: torch.Tensor  # [B, width] int64

    @property
    def num_rows(self) -> int:
        return int(self.slots.shape[0])

    @cached_property
    def writer(self) -> torch.Tensor:
        """[B]: for each row, the first row of the same slot (itself, except for a CUDA graph's
        pad rows, which copy row 0). Values written to the pool are taken from that row, so
        duplicate writes to one place carry identical bits: a pad row's own results may differ
        from row 0's in the last bit (another GEMM row), which would make the write racy.
        Computed once per step (every layer's writes use it)."""
        same = self.slots[:, None] == self.slots[None, :]
        return same.to(torch.int8).argmax(dim=1)

    def shared_keys(self) -> frozenset:
        """What the step has memoised so far (:attr:`writer`, :meth:`memo` keys): addressing
        that both lanes of a two-lane step read (engine/side_lane.py), so it must be made
        before a fork, never on the side."""
        d = self.__dict__
        return frozenset(k for k in d if k != "_memo") | frozenset(d.get("_memo", {}))

    def memo(self, key: tuple, make: Callable[[], Any]) -> Any:
        """``make()``, computed once per step for ``key``: the addressing every layer of the
        step shares (ring rows, window bounds, entry rows of a rate), which each layer otherwise
        recomputes in a handful of small kernels."""
        cache = self.__dict__.setdefault("_memo", {})
        if key not in cache:
            cache[key] = make()
        return cache[key]

    def ring_rows(self, w: int) -> torch.Tensor:
        """[B] flat rows of the token in its slot's window ring of ``w`` rows."""
        return self.memo(("ring", w), lambda: self.slots * w + self.positions % w)

    def block_of(self, token_pos: torch.Tensor, block_size: int) -> torch.Tensor:
        """The block id holding token position ``token_pos`` [B] of each row -> [B]."""
        return self.tables.gather(1, (token_pos // block_size)[:, None])[:, 0]

    def entry_rows(self, entries: torch.Tensor, per_block: int) -> torch.Tensor:
        """Flat pool rows of entries ``entries`` ([B, K] entry numbers of each row's sequence,
        any value >= 0) -> [B, K]."""
        return self.tables.gather(1, entries // per_block) * per_block + entries % per_block


@dataclass(frozen=True)
class DecodeSpans:
    """The one-token sequences of a mixed step (prefill chunks beside decode tokens, what the
    scheduler runs under load), attended together as one decode step: their addressing and
    where their rows sit in the step's flat batch. Built once per step; every layer uses it."""

    rows: DecodeRows
    index: slice | torch.Tensor  # their rows of the flat batch: a slice when contiguous, else [B]
