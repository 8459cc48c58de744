"""The KV of several ranks seen as one: blocks leave and enter the worker in the one-rank layout.

Each rank stores the K/V of its own KV heads. The KV store (LMCache) copies whole blocks through
``KVLayout.export_blocks`` / ``import_blocks``; ``ShardedKVLayout`` answers those on rank 0 by
gathering every rank's heads into the bytes one rank would hold (and splitting them again on the
way in), so the stored bytes, and the layout fingerprint that names them, are the same at any
tensor-parallel size: a two-rank prefill worker hands its KV to a one-rank decode worker.
Runs on rank 0's engine thread only; the other ranks take part through ``follower.follow``.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.kv_layout import CacheKind, KVLayout
from engine.parallel.rank_group import Command, RankGroup


def _head_bytes(runner: Any, shard: Any) -> int:
    """Bytes of one rank's KV heads in one row (token, K or V, layer) of a block."""
    cfg = shard.rank_config
    return cfg.num_kv_heads * cfg.head_dim * runner.kv.data.element_size()


def export_rank_rows(runner: Any, shard: Any, group: RankGroup,
                     block_ids: list[int]) -> list[torch.Tensor] | None:
    """Every rank: its bytes of ``block_ids``; rank 0 gets all ranks' (CPU), in rank order."""
    rows = runner.plan.kv_layout.export_blocks(runner.kv, block_ids).cpu()
    return group.gather_cpu(rows)


def import_rank_resume(runner: Any, group: RankGroup, block_id: int,
                       data: torch.Tensor | None) -> None:
    """Every rank of a replicated KV: the resume state at the end of ``block_id`` (``data`` on
    rank 0, CPU [resume_state_bytes] uint8; broadcast from there)."""
    layout = runner.plan.kv_layout
    buf = data if data is not None else torch.empty(layout.resume_state_bytes, dtype=torch.uint8)
    group.broadcast_cpu(buf)
    layout.import_resume_state(runner.kv, block_id, buf)


def import_rank_rows(runner: Any, shard: Any, group: RankGroup, block_ids: list[int],
                     data: torch.Tensor | None) -> None:
    """Every rank: take its heads out of the one-rank bytes (``data`` on rank 0, CPU
    [n, full bytes per block] uint8; broadcast from there) and write them into its blocks.
    ``shard`` None: every rank holds the whole KV (replicated) and writes all of it."""
    rank_bytes = runner.plan.kv_layout.bytes_per_block
    if shard is None:
        buf = data if data is not None else torch.empty((len(block_ids), rank_bytes),
                                                        dtype=torch.uint8)
        group.broadcast_cpu(buf)
        runner.plan.kv_layout.import_blocks(runner.kv, block_ids, buf)
        return
    per = _head_bytes(runner, shard)
    full = per * shard.cfg.num_kv_heads // shard.rank_config.num_kv_heads
    shape = (len(block_ids), rank_bytes // per * full)
    buf = data if data is not None else torch.empty(shape, dtype=torch.uint8)
    group.broadcast_cpu(buf)
    heads = shard.kv_heads()
    rows = buf.view(len(block_ids), -1, full)
    lo = heads.start * per // len(heads)
    mine = rows[:, :, lo:lo + per].reshape(len(block_ids), rank_bytes)
    runner.plan.kv_layout.import_blocks(runner.kv, block_ids, mine)


class ShardedKVLayout(KVLayout):
    """Rank 0's KV as the KV store sees it: the geometry and fingerprint of the one-rank layout
    (``full``), the bytes gathered from / scattered to every rank. ``shard`` None: the ranks
    hold the KV replicated; rank 0's blocks are exported and imports go to every rank."""

    def __init__(self, full: KVLayout, runner: Any, shard: Any, group: RankGroup) -> None:
        self.full = full
        self.block_size = full.block_size
        self.runner, self.shard, self.group = runner, shard, group

    @property
    def kinds(self) -> tuple[CacheKind, ...]:
        return self.full.kinds

    @property
    def fingerprint(self) -> str:
        return self.full.fingerprint

    @property
    def resume_granularity(self) -> int:
        return self.full.resume_granularity

    @property
    def resume_state_bytes(self) -> int:
        return self.full.resume_state_bytes

    def export_resume_state(self, kv: Any, block_id: int) -> torch.Tensor | None:
        # only a replicated KV keeps resume state beside its blocks: rank 0's is every rank's
        return self.full.export_resume_state(self.runner.kv, block_id)

    def import_resume_state(self, kv: Any, block_id: int, data: torch.Tensor) -> None:
        assert self.shard is None, "resume state beside the blocks is kept only replicated"
        self.group.send(Command("import_resume", (block_id,)))
        import_rank_resume(self.runner, self.group, block_id, data.contiguous().cpu())

    def can_resume_after(self, kv: Any, block_id: int) -> bool:
        return self.full.can_resume_after(self.runner.kv, block_id)  # rank 0's bookkeeping

    def resumable_tokens(self, kv: Any, block_ids: list[int], num_tokens: int) -> int:
        return self.full.resumable_tokens(self.runner.kv, block_ids, num_tokens)

    def allocate(self, num_blocks: int, device: torch.device) -> Any:
        raise AssertionError("each rank allocates its own KV (engine/parallel/rank_runner.py)")

    def export_blocks(self, kv: Any, block_ids: list[int]) -> torch.Tensor:
        if self.shard is None:
            return self.full.export_blocks(self.runner.kv, block_ids)
        self.group.send(Command("export", (tuple(block_ids),)))
        parts = export_rank_rows(self.runner, self.shard, self.group, list(block_ids))
        assert parts is not None
        per = _head_bytes(self.runner, self.shard)
        n = len(block_ids)
        # replicated KV heads: the first rank of each replica set speaks for it
        owners = parts[:: self.shard.kv_replicas]
        rows = torch.cat([p.view(n, -1, per) for p in owners], dim=2)
        return rows.reshape(n, -1).to(self.runner.kv.data.device)

    def import_blocks(self, kv: Any, block_ids: list[int], data: torch.Tensor) -> None:
        self.group.send(Command("import", (tuple(block_ids),)))
        import_rank_rows(self.runner, self.shard, self.group, list(block_ids),
                         data.contiguous().cpu())
