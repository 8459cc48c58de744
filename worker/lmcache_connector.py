"""LMCache connector for Bulkhead's paged KV cache.

LMCache moves KV in "memory objects" shaped ``[2, num_layers, n, num_kv_heads * head_dim]``
(K/V first, then layer: LMCache's KV_2LTD format). Our engine keeps one paged tensor
``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` and a block table per
sequence (docs/architecture.md, "Paged KV layout"). This connector gathers tokens ``[start, end)``
of one sequence out of the paged tensor into a memory object (store) and scatters a memory object
back into the paged tensor (retrieve). LMCache hands our keyword arguments through untouched:
every call carries ``kv_data`` (the paged tensor) and ``block_ids`` (the sequence's block table).

It never allocates device memory beyond one small index tensor per call and never writes a
block outside the ``block_ids`` it was given.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryObj

from worker.paged_kv import token_slots


class PagedKVConnector(GPUConnectorInterface):
    """Gathers from / scatters into ``KVCache.data`` by block table (one sequence per call)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.kvcaches = None  # LMCache's base class reads this attribute; we pass KV per call.

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.num_kv_heads * self.head_dim])

    # ------------------------------------------------------------------ helpers
    def _flat_view(self, kv_data: torch.Tensor) -> torch.Tensor:
        # kv_data: [L, 2, num_blocks, block_size, H, D] -> [L, 2, num_blocks * block_size, H * D]
        expected = (self.num_layers, 2, self.num_kv_heads, self.head_dim)
        got = (kv_data.shape[0], kv_data.shape[1], kv_data.shape[4], kv_data.shape[5])
        if kv_data.dim() != 6 or got != expected:
            raise ValueError(
                f"kv_data shape {tuple(kv_data.shape)} does not match the connector's layout "
                f"[num_layers={self.num_layers}, 2, num_blocks, block_size, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}]"
            )
        assert kv_data.is_contiguous(), "the paged KV tensor must be contiguous"
        num_slots = kv_data.shape[2] * kv_data.shape[3]
        return kv_data.view(self.num_layers, 2, num_slots, self.num_kv_heads * self.head_dim)

    @staticmethod
    def _args(kwargs: dict[str, Any]) -> tuple[torch.Tensor, Sequence[int]]:
        try:
            return kwargs["kv_data"], kwargs["block_ids"]
        except KeyError as e:
            raise TypeError(f"PagedKVConnector needs keyword argument {e.args[0]!r}") from None

    def _object_tensor(self, memory_obj: MemoryObj, num_tokens: int) -> torch.Tensor:
        tensor = memory_obj.tensor
        assert tensor is not None, "LMCache memory object has no tensor"
        # tensor: [2, L, n, H * D]
        assert tuple(tensor.shape) == tuple(self.get_shape(num_tokens)), (
            f"memory object shape {tuple(tensor.shape)} != {tuple(self.get_shape(num_tokens))}"
        )
        return tensor

    # ------------------------------------------------------------------ LMCache interface
    @torch.inference_mode()
    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        """Copy tokens ``[start, end)`` of the sequence into ``memory_obj``."""
        kv_data, block_ids = self._args(kwargs)
        flat = self._flat_view(kv_data)
        slots = token_slots(block_ids, kv_data.shape[3], start, end, kv_data.device)
        gathered = flat.index_select(2, slots)  # [L, 2, n, H * D]
        self._object_tensor(memory_obj, end - start).copy_(gathered.transpose(0, 1))

    @torch.inference_mode()
    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        """Copy ``memory_obj`` into the slots of tokens ``[start, end)`` of the sequence, except
        tokens before ``skip_tokens`` (kwarg): those the engine holds already, possibly in
        blocks shared with other sequences, and they are never overwritten."""
        kv_data, block_ids = self._args(kwargs)
        first = max(start, int(kwargs.get("skip_tokens", 0)))
        if first >= end:
            return
        flat = self._flat_view(kv_data)
        slots = token_slots(block_ids, kv_data.shape[3], first, end, kv_data.device)
        src = self._object_tensor(memory_obj, end - start).transpose(0, 1)  # [L, 2, n, H * D]
        src = src[:, :, first - start:]
        flat.index_copy_(2, slots, src.to(device=flat.device, dtype=flat.dtype))

    def batched_from_gpu(
        self,
        memory_objs: Any,
        starts: list[int],
        ends: list[int],
        **kwargs: Any,
    ) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(memory_obj, start, end, **kwargs)

    def batched_to_gpu(
        self,
        memory_objs: Any = None,
        starts: list[int] | None = None,
        ends: list[int] | None = None,
        **kwargs: Any,
    ) -> None:
        assert memory_objs is not None and starts is not None and ends is not None
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(memory_obj, start, end, **kwargs)
