"""How a family's attention state lives in the engine's pool of fixed-size blocks: the
``KVLayout`` contract and the ``CacheKind`` geometry it is made of.

A leaf of the engine: the planner, the block manager's callers, the KV import, the tensor-parallel
gather and the workers' KV store all speak this vocabulary, so it imports nothing of ours.
Nothing here allocates except ``KVLayout.allocate`` (once, at start-up).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class CacheKind:
    """One kind of data a KV block holds, with its geometry: a block of ``block_size`` tokens
    holds ``rows`` rows of ``row_bytes`` bytes of this kind (per layer that has it, ``layers``)."""

    name: str
    layers: int
    rows: int
    row_bytes: int

    @property
    def block_bytes(self) -> int:
        return self.layers * self.rows * self.row_bytes


class KVLayout(ABC):
    """How a family's attention state lives in the engine's pool of fixed-size blocks.

    Contract:
    - ``block_size`` tokens per block; a sequence holds ``ceil(tokens / block_size)`` blocks and
      block 0 is the null block (never handed out). A sequence can continue at a multiple of
      ``resume_granularity`` tokens from its blocks where ``can_resume_after`` its last block
      holds (a layout may keep part of that state beside the blocks and export it with them),
      so full blocks can be shared by prefix hash and exported / imported one by one. What a
      sequence needs beside the blocks to continue at a block end (``resume_state_bytes`` > 0)
      travels once per resume point (``export_resume_state`` / ``import_resume_state``), not in
      every block.
    - ``kinds`` describes each kind of data with its geometry; ``bytes_per_block`` is their sum
      and is what the planner multiplies by the number of blocks.
    - ``fingerprint`` changes whenever the bytes of a block would mean something else; two
      engines exchange blocks only when their fingerprints are equal.
    - ``allocate`` makes the storage once; ``export_blocks`` / ``import_blocks`` copy whole
      blocks out of / into it as ``[n, bytes_per_block]`` uint8 rows, never touching other
      blocks.
    """

    block_size: int

    @property
    @abstractmethod
    def kinds(self) -> tuple[CacheKind, ...]: ...

    @property
    def bytes_per_block(self) -> int:
        return sum(k.block_bytes for k in self.kinds)

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_per_block / self.block_size

    @property
    def resume_state_bytes(self) -> int:
        """Bytes of the state, kept beside the blocks, that a sequence needs to continue at a
        block end (0: the blocks are all of it, any full block end is a resume point)."""
        return 0

    def export_resume_state(self, kv: Any, block_id: int) -> torch.Tensor | None:
        """[resume_state_bytes] uint8 copy of what a sequence needs beside the blocks to continue
        at the end of ``block_id``, or None where none is kept (no resume point there)."""
        return None

    def import_resume_state(self, kv: Any, block_id: int, data: torch.Tensor) -> None:
        """Make the end of ``block_id`` (its contents just imported) a resume point with
        ``data`` (``export_resume_state``'s bytes for the same token prefix)."""
        raise AssertionError(f"{type(self).__name__} keeps no resume state beside its blocks")

    def can_resume_after(self, kv: Any, block_id: int) -> bool:
        """Whether a sequence whose prefix ends with this full block can continue there (the
        engine's prefix cache stops its hits at the last block where this holds)."""
        return True

    def resumable_tokens(self, kv: Any, block_ids: list[int], num_tokens: int) -> int:
        """Of ``num_tokens`` leading tokens just imported into ``block_ids``, how many a sequence
        can continue from (an import is cut back to it)."""
        return num_tokens

    @property
    def resume_granularity(self) -> int:
        """A sequence can continue from its blocks at multiples of this many tokens (imports and
        prefix hits are rounded down to it)."""
        return 1

    @property
    @abstractmethod
    def fingerprint(self) -> str: ...

    @abstractmethod
    def allocate(self, num_blocks: int, device: torch.device) -> Any:
        """The KV storage for ``num_blocks`` blocks (the engine's ``kv`` object)."""

    @abstractmethod
    def export_blocks(self, kv: Any, block_ids: list[int]) -> torch.Tensor:
        """Copies of the blocks: [len(block_ids), bytes_per_block] uint8 on the KV's device."""

    @abstractmethod
    def import_blocks(self, kv: Any, block_ids: list[int], data: torch.Tensor) -> None:
        """Write ``data`` ([n, bytes_per_block] uint8, any device) into the blocks."""
