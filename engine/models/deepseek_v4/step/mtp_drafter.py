"""Draft tokens from DeepSeek-V4's MTP layer (``speculative_method=mtp``), kept in step with the
main model's slots.

The MTP layer at position ``p`` needs the main model's streams at ``p`` and the token at
``p + 1`` (mtp.py). Within a step's chunk that token is the chunk's next token, so each step
the MTP layer absorbs the chunk's positions but the last (:meth:`absorb`, inside the family's
forward, one batched MTP pass); the last row's streams wait in a planned per-slot buffer until
its next token is known: the sampled token (then :meth:`propose` absorbs it and its output
is draft 1) or the next chunk's first token (then :meth:`absorb` takes it first).

Drafts 2..k run the MTP layer RECURRENTLY (layer 0 only: its output streams and the previous
draft in, one position further each time). Why not layer ``j`` for draft ``j`` of a checkpoint
with several: layer ``j``'s window would need layer ``j - 1``'s output streams at EVERY
earlier position, i.e. running every MTP layer over every position; the V4-Flash release has
one MTP layer anyway. Those draft positions write the MTP window ring; a
:class:`VerifySnapshots` copy taken before them is put back right after, so the ring again
holds only verified positions.

Rollback: a verify step's MTP rows are absorbed like any chunk's, after a copy of the MTP
slot's state (a second :class:`VerifySnapshots`); when the main slot rolls back
(memory/verify_snapshots.py) the MTP slot rolls back with it. A sequence that resumes at a block
boundary (prefix hit, KV import) starts the MTP window cold (zeroed): no MTP state travels
with blocks, which costs acceptance for the first ``W`` positions, never correctness.

State (the plan's ``mtp_state`` term): the MTP pool's window ring and resume windows for
``max_batch`` slots, the deferred streams ``max_batch x hc x d``, and the MTP snapshots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.memory_plan import PlanTerm
from engine.models.deepseek_v4.config import DeepseekV4Config
from engine.models.deepseek_v4.layers.mtp import V4MTPLayer, mtp_config
from engine.models.deepseek_v4.memory.extent import resume_window_bytes, slot_carry_bytes
from engine.models.deepseek_v4.memory.kv_pool import DeepseekV4KVPool
from engine.models.deepseek_v4.memory.verify_snapshots import VerifySnapshots, verify_snapshot_bytes


def mtp_state_bytes(cfg: DeepseekV4Config, max_batch: int, k: int, dtype: torch.dtype) -> int:
    """Device bytes of :class:`MtpDrafter`'s state (its weights are in the weights term)."""
    m = mtp_config(cfg)
    e = torch.empty((), dtype=dtype).element_size()
    return (slot_carry_bytes(m, max_batch, dtype) + resume_window_bytes(m, max_batch, dtype, False)
            + max_batch * cfg.hc_mult * cfg.hidden_size * e
            + verify_snapshot_bytes(m, max_batch, k, dtype))


@dataclass(frozen=True)
class MtpRow:
    """One sequence of a step as the MTP pass sees it."""

    slot: int
    start: int  # the chunk's first position
    first: bool  # its first chunk in the slot (resumed from blocks when start > 0)
    is_verify: bool
    table: list[int]


class MtpDrafter:
    def __init__(self, cfg: DeepseekV4Config, layer: V4MTPLayer, max_batch: int, k: int,
                 block_size: int, dtype: torch.dtype, device: torch.device | str) -> None:
        """``block_size``: the main pool's (the MTP slot is addressed by the same tables)."""
        self.cfg, self.layer, self.k = cfg, layer, k
        m = mtp_config(cfg)
        # a sliding layer keeps nothing in blocks: two empty ones, the window ring per slot
        self.pool = DeepseekV4KVPool(m, 2, block_size, max_batch, dtype, device)
        self.snapshots = VerifySnapshots(m, max_batch, k, dtype, device)
        self.deferred = torch.zeros(max_batch, cfg.hc_mult, cfg.hidden_size, dtype=dtype,
                                    device=device)
        self.deferred_pos: list[int | None] = [None] * max_batch
        self.tables: list[list[int]] = [[] for _ in range(max_batch)]  # each slot's last

    # --- keeping in step with the main slots ----------------------------------------------
    def bind(self, row: MtpRow, rolled_back: bool) -> None:
        """Before the main model's step: the MTP slot continues, starts fresh, starts cold
        (a resume from blocks) or rolls back with the main slot."""
        pool, slot = self.pool, row.slot
        if row.start == 0 or row.first:
            self.snapshots.drop(slot)
            pool.reset_slot(slot)
            self.deferred_pos[slot] = None
            if row.start:  # cold: no MTP window travels with the blocks
                for layer in pool.layers:
                    layer.ring[slot].zero_()
                pool.num_tokens[slot] = row.start
        elif rolled_back:
            p = self.snapshots.pending[slot]
            assert p is not None, "the main slot rolled back but the MTP slot has no copy"
            self.snapshots.rollback(pool, slot, p.start)
            self.deferred_pos[slot] = None

    def absorb(self, rows: list[MtpRow], input_ids: torch.Tensor, qsl: list[int],
               streams: torch.Tensor, ws: object | None) -> None:
        """After the main model's step: the MTP layer takes every position whose next token is
        in the step (one batched pass); each chunk's last row waits in ``deferred``.
        input_ids: [N] the step's tokens; streams: [N, hc, d] the main model's streams."""
        pool = self.pool
        ids, pos, h, mq, slots, tables = [], [], [], [0], [], []
        for i, r in enumerate(rows):
            b, e = qsl[i], qsl[i + 1]
            m = pool.num_tokens[r.slot]
            lead = self.deferred_pos[r.slot] == r.start - 1 and m == r.start - 1
            if not lead and m != r.start:  # a gap the MTP window did not see: start cold there
                for layer in pool.layers:
                    layer.ring[r.slot].zero_()
                pool.num_tokens[r.slot] = m = r.start
            n = (e - b - 1) + lead
            if n > 0:
                ids.append(input_ids[b + 1 - lead:e])
                pos.append(torch.arange(m, m + n, device=input_ids.device))
                parts = ([self.deferred[r.slot:r.slot + 1]] if lead else []) + [streams[b:e - 1]]
                h.append(torch.cat(parts))
                mq.append(mq[-1] + n)
                slots.append(r.slot)
                tables.append(r.table)
                if r.is_verify:
                    self.snapshots.take(pool, r.slot, m, n, r.table)
            self.tables[r.slot] = r.table
            self.deferred[r.slot] = streams[e - 1]
            self.deferred_pos[r.slot] = r.start + (e - b) - 1
        if slots:
            self.layer.h_in = torch.cat(h)
            self.layer(torch.cat(ids), torch.cat(pos), mq, slots, pool, ws, tables)

    # --- drafting ---------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, reqs: list[tuple[int, int, int, int, list[int]]],
                ws: object | None) -> list[list[int]]:
        """reqs: (slot, last token, its position, drafts wanted, block table) of running
        decodes -> each one's greedy MTP drafts ([] where the MTP slot is not at the token)."""
        pool, out = self.pool, [[] for _ in reqs]
        live = [i for i, (slot, _t, p, k, _tb) in enumerate(reqs)
                if k > 0 and self.deferred_pos[slot] == p - 1 and pool.num_tokens[slot] == p - 1]
        if not live:
            return out
        slots = [reqs[i][0] for i in live]
        kmax = max(reqs[i][3] for i in live)
        # draft positions run past the blocks the sequence holds: the MTP layer keeps nothing
        # in blocks (sliding only), so the null block stands in for the missing ones
        bs = pool.block_size
        tables = [reqs[i][4] + [0] * (-(-(reqs[i][2] + kmax) // bs) - len(reqs[i][4]))
                  for i in live]
        dev = self.deferred.device
        ids = torch.tensor([reqs[i][1] for i in live], device=dev)
        pos = torch.tensor([reqs[i][2] - 1 for i in live], device=dev)
        qsl = list(range(len(live) + 1))
        self.layer.h_in = self.deferred[torch.tensor(slots, device=dev)]
        for j in range(kmax):
            if j == 1:  # draft positions from here on: copy the window state to put it back
                for i, table in zip(live, tables, strict=True):
                    slot, _t, p, _k, _tb = reqs[i]
                    self.snapshots.take(pool, slot, p, kmax - 1, table)
            hidden = self.layer(ids, pos, qsl, slots, pool, ws, tables)
            ids = self.layer.compute_logits(hidden).argmax(dim=-1)
            for n, i in enumerate(live):
                if j < reqs[i][3]:
                    out[i].append(int(ids[n]))
            if j == 0:
                for slot in slots:
                    self.deferred_pos[slot] = None
            assert self.layer.streams_out is not None
            self.layer.h_in = self.layer.streams_out
            pos = pos + 1
        if kmax > 1:
            for i in live:
                slot, _t, p, _k, _tb = reqs[i]
                self.snapshots.rollback(pool, slot, p)
        return out

    def warm_up(self) -> None:
        """After the warm-up's steps: draft once (k drafts) from every slot's deferred row, so
        the drafting pass and its snapshot copies run before the workspace is locked; then
        forget every slot."""
        reqs = [(slot, 0, p + 1, self.k, self.tables[slot])
                for slot, p in enumerate(self.deferred_pos)
                if p is not None and self.pool.num_tokens[slot] == p]
        if reqs:
            self.propose(reqs, None)
        for slot in range(self.pool.max_batch):
            self.pool.reset_slot(slot)
            self.snapshots.drop(slot)
            self.deferred_pos[slot] = None
        self.pool.reset_windows()


def speculation_terms(v4: DeepseekV4Config, ec: EngineConfig, dtype: torch.dtype) -> list[PlanTerm]:
    """The plan terms speculation adds: the verify snapshots (any method) and, for mtp, the MTP
    layer's own state."""
    terms: list[PlanTerm] = []
    if ec.spec_tokens:
        terms.append(PlanTerm(
            "verify_snapshots", verify_snapshot_bytes(v4, ec.max_batch, ec.spec_tokens, dtype),
            f"max_batch {ec.max_batch} x (layers x (k {ec.spec_tokens} + 1) ring rows x "
            f"head_dim {v4.head_dim} + per compressor 2 x rate x width + per CSA compressor "
            "rate x dim overlap row + fp32 gate) x dtype: what a verify step overwrites, "
            "put back on a rejected draft (memory/verify_snapshots.py)"))
    if ec.speculative_method == "mtp":
        terms.append(PlanTerm(
            "mtp_state", mtp_state_bytes(v4, ec.max_batch, ec.spec_tokens, dtype),
            f"the MTP layer's state for max_batch {ec.max_batch} slots: its window ring "
            f"({v4.sliding_window} x head_dim {v4.head_dim}) and resume windows, the deferred "
            f"streams (hc {v4.hc_mult} x hidden {v4.hidden_size}) and its verify snapshots "
            "(step/mtp_drafter.py)"))
    return terms
