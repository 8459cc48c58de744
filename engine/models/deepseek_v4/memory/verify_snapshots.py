"""Exact rollback of DeepSeek-V4's per-slot state after a verify step rejects a draft.

A verify step (engine/spec_decode.py) computes a sequence's last token and its ``d`` drafts,
positions ``[s, s + d]``, in one forward. Dense families write only the KV of those positions,
so a rejected draft's KV is just overwritten later. V4 also advances state that later positions
READ, and part of it is overwritten in place by the step:
- the sliding-window ring (``[W, D]`` per layer, position ``p`` at ``p % W``): positions
  ``s..s+d`` overwrite the keys of ``s-W..s+d-W``, which later positions still attend;
- the open compressor window's raw projections (``buf_kv``/``buf_gate``, compressor and
  indexer): a window that closes inside the drafts restarts the buffer with the drafts' rows;
- the CSA overlap carry (``ov_kv``/``ov_gate`` per block): the next window to close reads the
  Ca slice of window ``s // r - 1`` from its block, which a window closing among the drafts may
  overwrite (same block);
- the slot's token count, and a window snapshot (resume_windows.py) planned at a block end
  the drafts reach.
Everything else the step writes (compressed entries, indexer keys, window snapshots of later
block ends, overlap carry of later windows) is addressed by position and written again before
anything reads it.

The scheme, chosen as the simplest that is exact: before the forward, copy what the step will
overwrite of the state at ``s`` into this fixed buffer (the ``d + 1`` ring rows per layer, the
open-window buffers, the one overlap-carry row per CSA compressor). If every draft is kept
the copy is simply not used. If one is rejected, the scheduler counts NONE of the step's
positions as computed (``SchedulerConfig.restart_rejected_verify``): the sequence's kept
tokens (its last token, the accepted drafts and the new token) are recomputed by its next chunk,
which starts again at ``s``; binding that chunk to the slot (``bind_slot`` below) restores
this copy first, and forgets any window snapshot planned past ``s``. So the rollback costs no
extra forward: the recompute rides in the next step, whose chunk then carries the ``a + 2``
tokens instead of one (and no drafts: a sequence drafts only when one token is uncomputed).
Exact truncation without a copy was not chosen: it would need a ring of ``W + k`` rows and
position-indexed open-window buffers, changing the pool layout that blocks, exports and the
CUDA-graph decode share.

Memory: ``max_batch`` slots of ``layers x (k + 1) x D x e`` ring rows, plus per compressed layer
``2 x r x width x e`` (open window) and per CSA compressor ``r x dim x (e + 4)`` (one overlap
row); the plan term ``verify_snapshots`` (docs/memory.md). Allocated once at construction;
a snapshot or a restore only copies between fixed tensors (with the step's small index tensors,
as the pool's own bookkeeping does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.errors import InvalidRequest
from engine.models.deepseek_v4.config import CSA, SLIDING, DeepseekV4Config
from engine.models.deepseek_v4.memory.kv_pool import CompressorPool, DeepseekV4KVPool


def verify_snapshot_bytes(cfg: DeepseekV4Config, max_batch: int, k: int,
                          dtype: torch.dtype) -> int:
    """Bytes of :class:`VerifySnapshots` for ``k`` drafts a step (0 when ``k`` is 0)."""
    if k == 0:
        return 0
    e = torch.empty((), dtype=dtype).element_size()
    total = 0
    for lt in cfg.layer_types:
        total += max_batch * (k + 1) * cfg.head_dim * e
        if lt == SLIDING:
            continue
        dims = [(cfg.head_dim, lt == CSA)] + ([(cfg.index_head_dim, True)] if lt == CSA else [])
        for dim, overlap in dims:
            width = 2 * dim if overlap else dim
            total += 2 * max_batch * cfg.rate(lt) * width * e
            if overlap:
                total += max_batch * cfg.rate(lt) * dim * (e + 4)
    return total


@dataclass
class _CompressorCopy:
    buf_kv: torch.Tensor  # [max_batch, rate, width]
    buf_gate: torch.Tensor  # [max_batch, rate, width]
    ov_kv: torch.Tensor | None  # [max_batch, rate, dim]: the overlap row of window s // r - 1
    ov_gate: torch.Tensor | None  # [max_batch, rate, dim] fp32


@dataclass(frozen=True)
class _Pending:
    start: int  # the verify chunk's first position: the state copied is the state there
    end: int  # the slot's token count after the verify step
    ring_rows: torch.Tensor  # [n] ring rows the step overwrote ((start + j) % W)
    ov_block: int | None  # the block whose overlap row was copied (None: no window closed yet)
    table: tuple[int, ...]


class VerifySnapshots:
    """Per slot, the state a verify step overwrites, to put back when a draft is rejected."""

    def __init__(self, cfg: DeepseekV4Config, max_batch: int, k: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        assert k >= 1
        dev = torch.device(device)
        self.cfg, self.rows = cfg, k + 1
        self.rings = [torch.zeros(max_batch, k + 1, cfg.head_dim, dtype=dtype, device=dev)
                      for _ in cfg.layer_types]
        self.comps: list[list[_CompressorCopy]] = []
        for lt in cfg.layer_types:
            copies = []
            if lt != SLIDING:
                dims = [(cfg.head_dim, lt == CSA)]
                dims += [(cfg.index_head_dim, True)] if lt == CSA else []
                r = cfg.rate(lt)
                for dim, overlap in dims:
                    w = 2 * dim if overlap else dim
                    copies.append(_CompressorCopy(
                        torch.zeros(max_batch, r, w, dtype=dtype, device=dev),
                        torch.zeros(max_batch, r, w, dtype=dtype, device=dev),
                        torch.zeros(max_batch, r, dim, dtype=dtype, device=dev) if overlap else None,
                        torch.zeros(max_batch, r, dim, dtype=torch.float32, device=dev)
                        if overlap else None))
            self.comps.append(copies)
        self.pending: list[_Pending | None] = [None] * max_batch

    def nbytes(self) -> int:
        ts = list(self.rings) + [t for cs in self.comps for c in cs
                                 for t in (c.buf_kv, c.buf_gate, c.ov_kv, c.ov_gate) if t is not None]
        return sum(t.numel() * t.element_size() for t in ts)

    @staticmethod
    def _pools(pool: DeepseekV4KVPool, i: int) -> list[CompressorPool]:
        layer = pool.layers[i]
        return [cp for cp in (layer.compressor, layer.indexer) if cp is not None]

    def take(self, pool: DeepseekV4KVPool, slot: int, start: int, num_tokens: int,
             table: list[int] | tuple[int, ...]) -> None:
        """Before a verify chunk of ``num_tokens`` tokens at ``start`` runs in ``slot`` (bound
        and standing at ``start``): copy what it will overwrite."""
        assert num_tokens <= self.rows, f"verify chunk of {num_tokens} > {self.rows} tokens"
        assert pool.num_tokens[slot] == start
        w = self.cfg.sliding_window
        rows = torch.tensor([(start + j) % w for j in range(num_tokens)], dtype=torch.long,
                            device=pool.device)
        ov_block = None
        for i, layer in enumerate(pool.layers):
            self.rings[i][slot, :num_tokens] = layer.ring[slot].index_select(0, rows)
            for cp, copy in zip(self._pools(pool, i), self.comps[i], strict=True):
                copy.buf_kv[slot] = cp.buf_kv[slot]
                copy.buf_gate[slot] = cp.buf_gate[slot]
                e0 = start // cp.rate
                if copy.ov_kv is not None and copy.ov_gate is not None and e0 > 0:
                    assert cp.ov_kv is not None and cp.ov_gate is not None
                    ov_block = table[(e0 - 1) * cp.rate // cp.block_size]
                    copy.ov_kv[slot] = cp.ov_kv[ov_block]
                    copy.ov_gate[slot] = cp.ov_gate[ov_block]
        self.pending[slot] = _Pending(start, start + num_tokens, rows, ov_block, tuple(table))

    def rollback(self, pool: DeepseekV4KVPool, slot: int, start: int) -> bool:
        """If ``slot`` stands where its last verify step left it and that step began at
        ``start``: put the copied state back, so the slot stands at ``start``. -> whether it
        did (False: nothing to roll back to ``start``)."""
        p = self.pending[slot]
        if p is None or p.start != start or pool.num_tokens[slot] != p.end:
            return False
        n = p.ring_rows.numel()
        for i, layer in enumerate(pool.layers):
            layer.ring[slot].index_copy_(0, p.ring_rows, self.rings[i][slot, :n])
            for cp, copy in zip(self._pools(pool, i), self.comps[i], strict=True):
                cp.buf_kv[slot] = copy.buf_kv[slot]
                cp.buf_gate[slot] = copy.buf_gate[slot]
                if p.ov_block is not None and copy.ov_kv is not None and copy.ov_gate is not None:
                    assert cp.ov_kv is not None and cp.ov_gate is not None
                    cp.ov_kv[p.ov_block] = copy.ov_kv[slot]
                    cp.ov_gate[p.ov_block] = copy.ov_gate[slot]
        # a window snapshot taken at a block end past `start` holds rejected keys
        bs = pool.block_size
        pool.windows.forget([p.table[b] for b in range(start // bs, p.end // bs)
                             if start < (b + 1) * bs <= p.end])
        pool.num_tokens[slot] = start
        self.pending[slot] = None
        return True

    def drop(self, slot: int) -> None:
        """The slot starts or resumes another sequence: its copy means nothing now."""
        self.pending[slot] = None


def bind_slot(pool: DeepseekV4KVPool, slot: int, start: int, first: bool,
               block_ids: list[int] | tuple[int, ...],
               snapshots: VerifySnapshots | None = None) -> bool:
    """Make ``slot`` ready for a chunk at position ``start``: fresh, resumed from its blocks,
    continued (then it must stand exactly there), or rolled back to the start of its last
    verify step, which rejected a draft (verify_snapshots.py)."""
    if snapshots is not None and (start == 0 or first):
        snapshots.drop(slot)
    if start == 0:
        pool.reset_slot(slot)
    elif first:
        pool.restore_slot(slot, pool.table(slot, block_ids), start)
    elif pool.num_tokens[slot] != start:
        if snapshots is not None and snapshots.rollback(pool, slot, start):
            return True
        raise InvalidRequest(
            f"V4 slot {slot} holds {pool.num_tokens[slot]} tokens but the step continues "
            f"at position {start}", field="cache_slots")
    return False
