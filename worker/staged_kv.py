"""What a KV fetch leaves in host memory for the engine thread to import: the stored blocks of
a prompt's longest stored prefix and, for a layout that keeps state beside its blocks (V4's
window snapshot), the resume point's state. Plain data; never touches the device or a store."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class StagedKV:
    blocks: torch.Tensor  # [num_blocks, bytes_per_block] uint8 on the host, the prompt's blocks
    resume_end: int = 0  # tokens: the block end whose resume state is ``resume`` (0: none)
    resume: torch.Tensor | None = None  # [resume_state_bytes] uint8 on the host
    region: Any = None  # the host staging region ``blocks`` lies in, reserved while this lives

    @property
    def num_blocks(self) -> int:
        return self.blocks.shape[0]
