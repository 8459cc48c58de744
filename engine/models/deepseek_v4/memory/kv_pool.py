"""DeepSeek-V4's attention state in blocks of one pool allocated at start-up.

A block covers ``block_size`` tokens (a multiple of every compression rate, so no compressor
window straddles two blocks) and holds, per compressed layer:
- the ``block_size / rate`` compressed entries whose windows lie in the block;
- CSA layers: as many indexer keys, and the compressor carry at the block's end: the overlap
  state (Ca slice and gate of the block's last window) of the compressor and of the indexer.
At a block boundary no compressor window is open, so that carry is ALL the compressor state
there. The sliding window at a block's end is NOT in the block: it lives in a small separate
pool of snapshots (:mod:`.resume_windows`) taken at the last block end each step reaches, so a
sequence resumes (prefix hit, import of stored blocks) at a block end that has a snapshot.
Stored entries and window keys are the model dtype or FP8 e4m3 with one fp32 scale per row
(``fp8=True``); carry stays exact.

Per running sequence (``max_batch`` slots, small and fixed): the window ring of the last
``sliding_window`` keys and the open compressor window's raw projections (< rate tokens).

Nothing here allocates after construction; reads gather rows by block table into new tensors of
the step (bounded by the planned context, counted in the plan's activations).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.errors import InvalidRequest
from engine.models.deepseek_v4.config import CSA, SLIDING, DeepseekV4Config
from engine.models.deepseek_v4.memory.extent import (
    block_multiple,
    blocks_per_sequence,
    check_block_size,
    slot_run_blocks,
    v4_fingerprint,
)
from engine.models.deepseek_v4.memory.paged_rows import PagedRows
from engine.models.deepseek_v4.memory.resume_windows import ResumeWindows, num_resume_slabs


@dataclass
class CompressorPool:
    """One compressor's (or indexer's) part of the pool for one layer, plus its slot carry."""

    rate: int
    block_size: int
    entries: PagedRows  # block_size / rate entries per block
    ov_kv: torch.Tensor | None  # CSA: [num_blocks, rate, dim] Ca slice of the block's last window
    ov_gate: torch.Tensor | None  # CSA: [num_blocks, rate, dim] fp32, its gate + position bias
    buf_kv: torch.Tensor  # [max_batch, rate, width] raw kv projections of the open window
    buf_gate: torch.Tensor  # [max_batch, rate, width]

    def entry_rows(self, table: torch.Tensor, first: int, count: int) -> torch.Tensor:
        """Flat rows of a sequence's entries ``[first, first + count)``; table: [blocks] int64."""
        per = self.entries.rows
        e = torch.arange(first, first + count, device=table.device)
        return table[e // per] * per + e % per

    def block_of_window(self, table: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return table[w * self.rate // self.block_size]

    def block_tensors(self) -> list[torch.Tensor]:
        out = self.entries.tensors()
        if self.ov_kv is not None and self.ov_gate is not None:
            out += [self.ov_kv, self.ov_gate]
        return out


@dataclass
class LayerPool:
    block_size: int
    index: int  # the layer's index: layer 0 plans each step's window snapshots
    windows: ResumeWindows  # shared by all layers
    ring: torch.Tensor  # [max_batch, W, D]; position p of a running sequence at p % W
    compressor: CompressorPool | None
    indexer: CompressorPool | None


def _compressor_pool(num_blocks: int, block_size: int, max_batch: int, rate: int, dim: int,
                     overlap: bool, dtype: torch.dtype, fp8: bool,
                     device: torch.device) -> CompressorPool:
    width = 2 * dim if overlap else dim
    return CompressorPool(
        rate=rate, block_size=block_size,
        entries=PagedRows(num_blocks, block_size // rate, dim, dtype, fp8, device),
        ov_kv=torch.zeros(num_blocks, rate, dim, dtype=dtype, device=device) if overlap else None,
        ov_gate=(torch.zeros(num_blocks, rate, dim, dtype=torch.float32, device=device)
                 if overlap else None),
        buf_kv=torch.zeros(max_batch, rate, width, dtype=dtype, device=device),
        buf_gate=torch.zeros(max_batch, rate, width, dtype=dtype, device=device),
    )


class DeepseekV4KVPool:
    """The fixed pool of V4 blocks plus the per-slot carry. ``num_tokens[slot]`` counts what a
    running sequence's slot has absorbed. A slot is either bound to block tables handed in per
    step (the engine) or, built with :meth:`for_slots`, to a fixed run of blocks of its own."""

    def __init__(self, cfg: DeepseekV4Config, num_blocks: int, block_size: int, max_batch: int,
                 dtype: torch.dtype, device: torch.device | str, fp8: bool = False) -> None:
        check_block_size(cfg, block_size)
        if max_batch < 1 or num_blocks < 2:
            raise InvalidRequest(f"max_batch={max_batch} must be >= 1 and num_blocks={num_blocks} "
                                 ">= 2 (the null block and one more)")
        self.cfg, self.num_blocks, self.block_size = cfg, num_blocks, block_size
        self.max_batch, self.dtype, self.fp8 = max_batch, dtype, fp8
        self.device = torch.device(device)
        self.num_tokens = [0] * max_batch
        self.static_tables: list[list[int]] | None = None
        self.layers: list[LayerPool] = []
        dev = self.device
        self.windows = ResumeWindows(cfg.num_layers, num_resume_slabs(max_batch),
                                     cfg.sliding_window, cfg.head_dim, dtype, fp8, dev)
        for i, lt in enumerate(cfg.layer_types):
            comp = idx = None
            if lt != SLIDING:
                rate = cfg.rate(lt)
                comp = _compressor_pool(num_blocks, block_size, max_batch, rate, cfg.head_dim,
                                        lt == CSA, dtype, fp8, dev)
                if lt == CSA:
                    idx = _compressor_pool(num_blocks, block_size, max_batch, rate,
                                           cfg.index_head_dim, True, dtype, fp8, dev)
            self.layers.append(LayerPool(
                block_size, i, self.windows,
                torch.zeros(max_batch, cfg.sliding_window, cfg.head_dim, dtype=dtype, device=dev),
                comp, idx))

    @classmethod
    def for_slots(cls, cfg: DeepseekV4Config, max_batch: int, max_context: int,
                  dtype: torch.dtype, device: torch.device | str, fp8: bool = False,
                  block_size: int | None = None) -> DeepseekV4KVPool:
        """A pool where slot ``s`` owns a fixed run of blocks covering ``max_context`` tokens
        (for model-level tests and benchmarks that address sequences by slot only)."""
        bs = block_size or block_multiple(cfg)
        per = blocks_per_sequence(max_context, bs)
        pool = cls(cfg, slot_run_blocks(max_batch, max_context, bs), bs, max_batch, dtype, device,
                   fp8)
        pool.static_tables = [list(range(1 + s * per, 1 + (s + 1) * per)) for s in range(max_batch)]
        return pool

    # --- bookkeeping -------------------------------------------------------------------------
    def table(self, slot: int, block_ids: list[int] | tuple[int, ...] | None) -> torch.Tensor:
        if block_ids is None:
            assert self.static_tables is not None, "no block table given and no static tables"
            block_ids = self.static_tables[slot]
        table = torch.tensor(list(block_ids), dtype=torch.long)
        if self.device.type != "cuda":
            return table
        # from pinned memory: a pageable copy would wait for the device's queue (a host sync
        # per sequence and step)
        return table.pin_memory().to(self.device, non_blocking=True)

    def reset_slot(self, slot: int) -> None:
        """Forget a slot's sequence (no tensor work: stale data is never read past num_tokens)."""
        self.num_tokens[slot] = 0

    def pretend_filled(self, slot: int, num_tokens: int) -> None:
        """Warm-up only: mark ``slot`` as holding ``num_tokens`` tokens (whatever its blocks
        contain) so a warm-up step runs against the longest context. Reset afterwards."""
        blocks = self.num_blocks - 1 if self.static_tables is None else len(self.static_tables[slot])
        if not 0 <= num_tokens <= blocks * self.block_size:
            raise InvalidRequest(f"num_tokens={num_tokens} outside [0, {blocks * self.block_size}]",
                                 field="num_tokens")
        self.num_tokens[slot] = num_tokens

    def check_room(self, slot: int, num_new: int, table: torch.Tensor) -> None:
        end = self.num_tokens[slot] + num_new
        if end > table.numel() * self.block_size:
            raise InvalidRequest(
                f"V4 cache slot {slot}: {self.num_tokens[slot]} + {num_new} tokens exceed its "
                f"{table.numel()} blocks of {self.block_size} tokens", field="block_tables")

    def restore_slot(self, slot: int, table: torch.Tensor, num_tokens: int) -> None:
        """Make ``slot`` continue a sequence whose first ``num_tokens`` tokens (a multiple of
        the block size) are in the blocks of ``table``: the window ring from the snapshot at
        the last block's end; no compressor window is open at a block boundary, so the open
        buffers stay empty."""
        if num_tokens % self.block_size:
            raise InvalidRequest(
                f"V4 resumes only at block boundaries: {num_tokens} is not a multiple of "
                f"block_size={self.block_size}", field="num_computed_tokens")
        if num_tokens:
            block = int(table[num_tokens // self.block_size - 1])
            self.windows.restore(block, num_tokens, [layer.ring[slot] for layer in self.layers])
        self.num_tokens[slot] = num_tokens

    def plan_windows(self, slot: int, block_ids: list[int], start: int, num_new: int) -> None:
        """Plan a step's window snapshot from the host block table (no device read). A table too
        short for the step is left to the model's own check (it names the limit)."""
        if -(-(start + num_new) // self.block_size) <= len(block_ids):
            self.windows.plan_step(slot, list(block_ids), start, num_new, self.block_size)

    def can_resume_after(self, block: int) -> bool:
        """Whether a sequence can continue at the end of ``block`` (its window is kept)."""
        return self.windows.has(block)

    def resumable_tokens(self, block_ids: list[int], num_tokens: int) -> int:
        """The longest prefix of at most ``num_tokens`` tokens in ``block_ids`` that a sequence
        can continue from: it ends at a block end with a window snapshot (or is empty)."""
        for n in range(num_tokens // self.block_size, 0, -1):
            if self.windows.has(block_ids[n - 1]):
                return n * self.block_size
        return 0

    def snapshot_from_rings(self, slot: int) -> None:
        """After a decode step (batched or a graph replay, which write only the rings): the
        window snapshot planned for ``slot`` this step, copied out of its rings."""
        for i, layer in enumerate(self.layers):
            self.windows.write_from_ring(i, slot, layer.ring[slot])
        self.windows.finish_step(slot)

    def reset_windows(self) -> None:
        self.windows.reset()

    # --- sizes and layout -------------------------------------------------------------------
    def block_tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by block first, in the fixed export order."""
        out: list[torch.Tensor] = []
        for layer in self.layers:
            for cp in (layer.compressor, layer.indexer):
                if cp is not None:
                    out += cp.block_tensors()
        return out

    def slot_tensors(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for layer in self.layers:
            out.append(layer.ring)
            for cp in (layer.compressor, layer.indexer):
                if cp is not None:
                    out += [cp.buf_kv, cp.buf_gate]
        return out

    def window_tensors(self) -> list[torch.Tensor]:
        return [t for p in self.windows.layers for t in p.tensors()]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in self.block_tensors() + self.slot_tensors() + self.window_tensors())

    @property
    def bytes_per_block(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.block_tensors())

    @property
    def fingerprint(self) -> str:
        return v4_fingerprint(self.cfg, self.block_size, self.dtype, self.fp8)

    def export_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """[n, bytes_per_block] uint8: the blocks' entries, indexer keys and carry (no windows:
        those leave one resume point at a time, :meth:`export_window`)."""
        idx = torch.as_tensor(block_ids, dtype=torch.long, device=self.device)
        return torch.cat([t.view(torch.uint8).index_select(0, idx).reshape(len(block_ids), -1)
                          for t in self.block_tensors()], dim=1)

    def import_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Write [n, bytes_per_block] uint8 into the blocks; their old window snapshots are
        dropped (the window that goes with the new contents comes by :meth:`import_window`)."""
        if data.dim() != 2 or data.shape != (len(block_ids), self.bytes_per_block):
            raise InvalidRequest(f"V4 block data {tuple(data.shape)}, expected "
                                 f"({len(block_ids)}, {self.bytes_per_block})", field="kv")
        idx = torch.as_tensor(block_ids, dtype=torch.long, device=self.device)
        data = data.to(self.device)
        off = 0
        for t in self.block_tensors():
            n = t[0].numel() * t.element_size()
            dst = t.view(torch.uint8)
            dst.index_copy_(0, idx, data[:, off:off + n].reshape(len(block_ids), *dst.shape[1:]))
            off += n
        self.windows.forget(block_ids)

    def export_window(self, block: int) -> torch.Tensor | None:
        """[window_section_bytes] uint8: the window snapshot at the end of ``block`` (what a
        sequence needs besides the blocks to resume there), or None if none is kept."""
        return self.windows.export_one(block)

    def import_window(self, block: int, data: torch.Tensor) -> None:
        """Make the end of ``block`` a resume point with the window ``data`` (export_window's)."""
        self.windows.import_one(block, data)
