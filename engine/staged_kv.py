"""What a KV fetch leaves in host memory for the engine to import: the stored blocks of a
prompt's longest stored prefix and, for a layout that keeps state beside its blocks (a window
snapshot), the resume point's state. Plain data; never touches the device or a store.

The engine copies it into a sequence's blocks a bounded slice per step (engine/kv_import_job.py)
and drops it, and with it ``region``, once no copy can still read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class StagedKV:
    blocks: torch.Tensor  # [num_blocks, bytes_per_block] uint8 on the host, the prompt's blocks
    num_tokens: int  # leading tokens of the prompt these blocks (and resume state) let it skip
    resume_end: int = 0  # tokens: the block end whose resume state is ``resume`` (0: none)
    resume: torch.Tensor | None = None  # [resume_state_bytes] uint8 on the host
    region: Any = None  # the host staging region ``blocks`` lies in, reserved while this lives

    def __post_init__(self) -> None:
        assert self.blocks.dim() == 2 and self.blocks.dtype == torch.uint8, self.blocks.shape
        assert self.num_tokens >= 0 and self.resume_end <= self.num_tokens

    @property
    def num_blocks(self) -> int:
        return self.blocks.shape[0]

    @property
    def nbytes(self) -> int:
        return self.blocks.shape[0] * self.blocks.shape[1]
