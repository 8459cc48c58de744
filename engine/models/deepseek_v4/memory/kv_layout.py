"""DeepSeek-V4's KV layout behind the engine's ``KVLayout`` contract: the cache kinds of a block,
resume at block ends with a window snapshot, and block export/import for the KV handoff, all
delegated to :class:`DeepseekV4KVPool`. Allocates only in :meth:`V4KVLayout.allocate`."""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.models.deepseek_v4.config import DeepseekV4Config
from engine.models.deepseek_v4.memory.extent import (
    block_bytes_by_kind,
    check_block_size,
    v4_fingerprint,
    window_section_bytes,
)
from engine.models.deepseek_v4.memory.kv_pool import DeepseekV4KVPool
from engine.models.family import CacheKind, KVLayout


class V4KVLayout(KVLayout):
    """Blocks of ``block_size`` tokens holding the compressed entries, indexer keys and CSA
    carry of every layer (see kv_pool.py); resumable at block ends that have a window snapshot
    (resume_windows.py). Exported blocks carry no window: a snapshot is the resume state of the
    block end it belongs to and leaves once (``export_resume_state``)."""

    def __init__(self, cfg: DeepseekV4Config, ec: EngineConfig) -> None:
        check_block_size(cfg, ec.block_size)
        self.cfg, self.block_size = cfg, ec.block_size
        self.dtype, self.fp8, self.max_batch = ec.torch_dtype, ec.kv_dtype == "fp8", ec.max_batch

    @property
    def kinds(self) -> tuple[CacheKind, ...]:
        return tuple(CacheKind(name, n, rows, rb) for name, (n, rows, rb)
                     in block_bytes_by_kind(self.cfg, self.block_size, self.dtype, self.fp8).items())

    @property
    def resume_granularity(self) -> int:
        return self.block_size

    @property
    def fingerprint(self) -> str:
        return v4_fingerprint(self.cfg, self.block_size, self.dtype, self.fp8)

    @property
    def resume_state_bytes(self) -> int:
        return window_section_bytes(self.cfg, self.dtype, self.fp8)

    def export_resume_state(self, kv: DeepseekV4KVPool, block_id: int) -> torch.Tensor | None:
        return kv.export_window(block_id)

    def import_resume_state(self, kv: DeepseekV4KVPool, block_id: int, data: torch.Tensor) -> None:
        kv.import_window(block_id, data)

    def can_resume_after(self, kv: DeepseekV4KVPool, block_id: int) -> bool:
        return kv.can_resume_after(block_id)

    def resumable_tokens(self, kv: DeepseekV4KVPool, block_ids: list[int], num_tokens: int) -> int:
        return kv.resumable_tokens(block_ids, num_tokens)

    def allocate(self, num_blocks: int, device: torch.device) -> DeepseekV4KVPool:
        return DeepseekV4KVPool(self.cfg, num_blocks, self.block_size, self.max_batch, self.dtype,
                                device, self.fp8)

    def export_blocks(self, kv: DeepseekV4KVPool, block_ids: list[int]) -> torch.Tensor:
        return kv.export_blocks(block_ids)

    def import_blocks(self, kv: DeepseekV4KVPool, block_ids: list[int], data: torch.Tensor) -> None:
        kv.import_blocks(block_ids, data)
