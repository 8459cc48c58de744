"""The one LMCache connector: whole KV blocks of any family's layout, as bytes.

LMCache moves a chunk of ``n`` tokens as one memory object; ours is ``[2, 1, n, row]`` uint8
(LMCache's KV_2LTD format with one virtual layer), which is ``n / block_size`` blocks of
``padded_block_bytes`` bytes, each the block's ``KVLayout.export_blocks`` bytes plus zero
padding. Chunks therefore hold whole blocks: a chunk starts and ends at block boundaries (the
store only hands LMCache block-aligned prefixes). What the bytes mean is the engine layout's
business; this connector only moves them.

Every call carries ``kv_data`` (the engine's KV storage, or a host staging tensor), its
``layout`` (an object with ``export_blocks(kv, ids)`` / ``import_blocks(kv, ids, data)``, e.g. the
engine's KVLayout or :class:`HostBlocks`) and ``block_ids`` (the sequence's block table).
It never writes a block outside the ``block_ids`` it is given, nor one below ``skip_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryObj


class HostBlocks:
    """The layout of a host staging tensor ``[num_blocks, bytes_per_block]`` uint8: blocks are
    its rows (what ``KVStore.fetch`` fills before the engine imports them)."""

    @staticmethod
    def export_blocks(kv: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
        return kv[torch.as_tensor(block_ids, dtype=torch.long)]

    @staticmethod
    def import_blocks(kv: torch.Tensor, block_ids: list[int], data: torch.Tensor) -> None:
        kv[torch.as_tensor(block_ids, dtype=torch.long)] = data.to(kv.device)


class BlockConnector(GPUConnectorInterface):
    """Copies whole blocks between a KV storage and LMCache memory objects."""

    def __init__(self, block_size: int, bytes_per_block: int, padded_block_bytes: int) -> None:
        assert padded_block_bytes >= bytes_per_block and padded_block_bytes % (2 * block_size) == 0
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self.padded = padded_block_bytes
        self.kvcaches = None  # LMCache's base class reads this attribute; we pass KV per call.

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, 1, num_tokens, self.padded // (2 * self.block_size)])

    def _blocks(self, start: int, end: int) -> tuple[int, int]:
        bs = self.block_size
        if start % bs or end % bs:
            raise ValueError(f"tokens [{start}, {end}) are not whole blocks of {bs}: the store "
                             "hands LMCache block-aligned prefixes only")
        return start // bs, end // bs

    def _object_bytes(self, memory_obj: MemoryObj, start: int, end: int) -> torch.Tensor:
        tensor = memory_obj.tensor
        assert tensor is not None, "LMCache memory object has no tensor"
        assert tuple(tensor.shape) == tuple(self.get_shape(end - start)), (
            f"memory object shape {tuple(tensor.shape)} != {tuple(self.get_shape(end - start))}")
        return tensor.view(-1).view((end - start) // self.block_size, self.padded)

    @staticmethod
    def _args(kwargs: dict[str, Any]) -> tuple[Any, Any, Sequence[int]]:
        try:
            return kwargs["kv_data"], kwargs["layout"], kwargs["block_ids"]
        except KeyError as e:
            raise TypeError(f"BlockConnector needs keyword argument {e.args[0]!r}") from None

    @torch.inference_mode()
    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        """Copy the blocks of tokens ``[start, end)`` into ``memory_obj``."""
        kv, layout, block_ids = self._args(kwargs)
        b0, b1 = self._blocks(start, end)
        if b1 > len(block_ids):
            raise ValueError(f"tokens [{start}, {end}) need {b1} blocks, the table has "
                             f"{len(block_ids)}")
        data = layout.export_blocks(kv, list(block_ids[b0:b1]))
        dst = self._object_bytes(memory_obj, start, end)
        dst[:, : self.bytes_per_block].copy_(data)
        dst[:, self.bytes_per_block :].zero_()

    @torch.inference_mode()
    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        """Copy ``memory_obj`` into the blocks of tokens ``[start, end)``, except those below
        ``skip_tokens`` (kwarg, rounded up to a block): the engine holds them already, maybe in
        blocks shared with other sequences, and they are never overwritten."""
        kv, layout, block_ids = self._args(kwargs)
        b0, b1 = self._blocks(start, end)
        skip = -(-int(kwargs.get("skip_tokens", 0)) // self.block_size)
        first = max(b0, skip)
        if first >= b1:
            return
        src = self._object_bytes(memory_obj, start, end)[first - b0 :, : self.bytes_per_block]
        layout.import_blocks(kv, list(block_ids[first:b1]), src)

    def batched_from_gpu(self, memory_objs: Any, starts: list[int], ends: list[int],
                         **kwargs: Any) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(memory_obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs: Any = None, starts: list[int] | None = None,
                       ends: list[int] | None = None, **kwargs: Any) -> None:
        assert memory_objs is not None and starts is not None and ends is not None
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(memory_obj, start, end, **kwargs)
