"""Sliding-window snapshots at block ends: the resume points of DeepSeek-V4 sequences.

A V4 sequence that continues at token ``E`` (a block boundary: a prefix hit, an import) needs
the rotated keys of its last ``sliding_window`` tokens in every layer. Keeping those rows in
every block would cost 128 of 256 rows a block at V4-Flash's shape, so they live here instead,
in a small pool of ``num_slabs`` slabs fixed at start-up. A slab holds one block end's window
(``sliding_window`` rows per layer) and is bound to that block's id.

When a step takes a sequence across one or more block boundaries, the window at the LAST of
them is written to a slab (every row needed is in that step's window keys: the slot's ring plus
the chunk); boundaries crossed inside a long prefill chunk get none. Slabs are a cache in LRU
order: a new snapshot takes the least recently used slab. At most one slab is taken per
sequence per step, so with ``num_slabs > max_batch`` a step never evicts a snapshot taken in
the same step. A block whose first token is written again (it was handed to a new sequence)
loses its snapshot. The window is not recomputed from tail tokens: a token's key in a layer
depends on the window before it, so only a stored window is exact.

Nothing here allocates device memory after construction except the small index tensors of a
step (as the rest of the step's bookkeeping does).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from engine.errors import InvalidRequest
from engine.models.deepseek_v4.memory.paged_rows import PagedRows


def num_resume_slabs(max_batch: int) -> int:
    """Slabs of a pool: one for each running sequence's newest snapshot, and as many again
    three times over to keep recent resume points (finished conversations, handoffs)."""
    return 4 * max_batch


class ResumeWindows:
    """``num_slabs`` window snapshots per layer, each bound to at most one block id."""

    def __init__(self, num_layers: int, num_slabs: int, window: int, dim: int, dtype: torch.dtype,
                 fp8: bool, device: torch.device) -> None:
        assert num_slabs >= 2
        self.window, self.num_slabs, self.device = window, num_slabs, device
        self.layers = [PagedRows(num_slabs, window, dim, dtype, fp8, device)
                       for _ in range(num_layers)]
        self.slab_of_block: dict[int, int] = {}
        self._block_of_slab: list[int | None] = [None] * num_slabs
        self._lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(num_slabs))
        # per slot: this step's snapshot write (window_kv rows, flat slab rows), and the
        # (start, num_new) it was planned for
        self._writes: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = {}
        self._planned: dict[int, tuple[int, int]] = {}

    # --- bookkeeping (host) ------------------------------------------------------------------
    def reset(self) -> None:
        self.slab_of_block.clear()
        self._block_of_slab = [None] * self.num_slabs
        self._lru = OrderedDict((s, None) for s in range(self.num_slabs))
        self._writes.clear()
        self._planned.clear()

    def has(self, block: int) -> bool:
        return block in self.slab_of_block

    def _forget(self, block: int) -> None:
        slab = self.slab_of_block.pop(block, None)
        if slab is not None:
            self._block_of_slab[slab] = None
            self._lru.move_to_end(slab, last=False)  # an unbound slab is the first to reuse

    def _bind(self, block: int) -> int:
        self._forget(block)
        slab, _ = self._lru.popitem(last=False)
        old = self._block_of_slab[slab]
        if old is not None:
            del self.slab_of_block[old]
        self._block_of_slab[slab] = block
        self.slab_of_block[block] = slab
        self._lru[slab] = None
        return slab

    def plan_step(self, slot: int, table: list[int], start: int, num_new: int,
                  block_size: int) -> None:
        """Once per sequence per step, before its layers write (the family plans from the host
        block table; else layer 0 does): drop the snapshots of blocks this step starts writing,
        and bind a slab to the last block end the step reaches."""
        self._planned[slot] = (start, num_new)
        num_prev = min(start, self.window - 1)
        end = start + num_new
        for i in range(-(-start // block_size), -(-end // block_size)):
            self._forget(table[i])
        last = end // block_size * block_size
        if last <= start:
            self._writes[slot] = None
            return
        slab = self._bind(table[last // block_size - 1])
        pos = torch.arange(max(0, last - self.window), last, device=self.device)
        self._writes[slot] = (pos - (start - num_prev), slab * self.window + pos - (last - self.window),
                              pos)

    def take_plan(self, slot: int, start: int, num_new: int) -> bool:
        """Whether this step of ``slot`` was planned already (consumed: a later step with the
        same positions, e.g. a repeated warm-up step, plans again)."""
        return self._planned.pop(slot, None) == (start, num_new)

    def write(self, layer: int, slot: int, window_kv: torch.Tensor) -> None:
        """window_kv: [num_prev + C, D], the step's window keys of the sequence in ``slot``."""
        plan = self._writes.get(slot)
        if plan is not None:
            self.layers[layer].write(plan[1], window_kv.index_select(0, plan[0]))

    def chunk_writes(self, slots: list[int], offsets: list[int]
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The planned snapshot writes of a step's chunks, for all of them at once: (rows of the
        step's window table, flat snapshot rows), chunk i's window keys starting at table row
        ``offsets[i]`` (chunk_rows.py). Built once per step (every layer writes through it)."""
        src, dst = [], []
        for slot, off in zip(slots, offsets, strict=True):
            plan = self._writes.get(slot)
            if plan is not None:
                src.append(plan[0] + off)
                dst.append(plan[1])
        return (torch.cat(src), torch.cat(dst)) if src else None

    def write_from_ring(self, layer: int, slot: int, ring: torch.Tensor) -> None:
        """:meth:`write` for a decode step, which updates only the slot's ring ([W, D]; position
        p at p % W): the snapshot's rows are all there once the step has run."""
        plan = self._writes.get(slot)
        if plan is not None:
            self.layers[layer].write(plan[1], ring.index_select(0, plan[2] % self.window))

    def finish_step(self, slot: int) -> None:
        """The step of ``slot`` has written its snapshot: forget its plan."""
        self._writes.pop(slot, None)
        self._planned.pop(slot, None)

    def restore(self, block: int, end: int, rings: list[torch.Tensor]) -> None:
        """Copy the window ending at token ``end`` (the end of ``block``) into ``rings``
        ([W, D] per layer; position p at p % W)."""
        slab = self.slab_of_block.get(block)
        if slab is None:
            raise InvalidRequest(f"no window snapshot for block {block}: a V4 sequence resumes "
                                 f"only at a block end that has one", field="block_tables")
        self._lru.move_to_end(slab)
        w = self.window
        pos = torch.arange(max(0, end - w), end, device=self.device)
        rows = slab * w + pos - (end - w)
        for ring, rows_l in zip(rings, self.layers, strict=True):
            ring[pos % w] = rows_l.read(rows)

    # --- export / import: one resume point at a time ------------------------------------------
    @property
    def section_bytes(self) -> int:
        """Bytes of one exported window: every layer's rows (+ FP8 scales)."""
        return sum(t[0].numel() * t.element_size() for p in self.layers for t in p.tensors())

    def forget(self, block_ids: list[int]) -> None:
        """Drop the snapshots of blocks whose contents are replaced from outside (an import)."""
        for block in block_ids:
            self._forget(block)

    def export_one(self, block: int) -> torch.Tensor | None:
        """[section_bytes] uint8: the snapshot at the end of ``block``, or None if it has none."""
        slab = self.slab_of_block.get(block)
        if slab is None:
            return None
        return torch.cat([t.view(torch.uint8)[slab].reshape(-1)
                          for p in self.layers for t in p.tensors()])

    def import_one(self, block: int, data: torch.Tensor) -> None:
        """Bind a slab to ``block`` holding the window ``data`` ([section_bytes] uint8, any
        device) that :meth:`export_one` gave for the same prefix."""
        if data.dim() != 1 or data.numel() != self.section_bytes:
            raise InvalidRequest(f"V4 window snapshot of {tuple(data.shape)} bytes, expected "
                                 f"({self.section_bytes},)", field="kv")
        slab, off = self._bind(block), 0
        data = data.to(self.device)
        for p in self.layers:
            for t in p.tensors():
                dst = t.view(torch.uint8)[slab]
                dst.copy_(data[off:off + dst.numel()].view(dst.shape))
                off += dst.numel()
