"""LMCache connector for per-token state rows (families whose attention state is per sequence,
such as DeepSeek-V4: engine/models/deepseek_v4/state_rows.py).

A state row of token ``t`` is one vector of ``row_width`` (even) values in the model dtype that
depends only on tokens ``[0, t]``, so LMCache's prefix-keyed chunks can hold it. LMCache's memory
objects are ``[2, num_layers, n, width]``; a row maps onto them as ONE virtual layer whose K half
is the row's first ``row_width / 2`` values and V half the rest: ``obj[h, 0, i] =
row_i[h * w : (h + 1) * w]``. (One virtual layer rather than the model's layers: the per-layer
widths differ - sliding / CSA / HCA - and padding every layer to the widest would waste bytes.)
Every call carries ``kv_data``: the host rows tensor ``[n_tokens, row_width]`` of one sequence.

Never writes outside rows ``[start, end)`` of the ``kv_data`` it is given, never allocates device
memory.
"""

from __future__ import annotations

from typing import Any

import torch
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryObj


class StateRowsConnector(GPUConnectorInterface):
    """Copies tokens' state rows into / out of LMCache memory objects (one sequence per call)."""

    def __init__(self, row_width: int) -> None:
        if row_width < 2 or row_width % 2:
            raise ValueError(f"row_width must be even and >= 2, got {row_width}")
        self.row_width = row_width
        self.half = row_width // 2
        self.kvcaches = None  # LMCache's base class reads this attribute; rows come per call.

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, 1, num_tokens, self.half])

    def _rows(self, kwargs: dict[str, Any]) -> torch.Tensor:
        rows = kwargs.get("kv_data")
        if rows is None:
            raise TypeError("StateRowsConnector needs keyword argument 'kv_data' (the rows)")
        if rows.dim() != 2 or rows.shape[1] != self.row_width:
            raise ValueError(f"state rows {tuple(rows.shape)} do not match the connector's "
                             f"[n, row_width={self.row_width}]")
        return rows

    def _object_tensor(self, memory_obj: MemoryObj, num_tokens: int) -> torch.Tensor:
        tensor = memory_obj.tensor
        assert tensor is not None, "LMCache memory object has no tensor"
        assert tuple(tensor.shape) == tuple(self.get_shape(num_tokens)), (
            f"memory object shape {tuple(tensor.shape)} != {tuple(self.get_shape(num_tokens))}")
        return tensor

    @torch.inference_mode()
    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        """Copy the rows of tokens ``[start, end)`` into ``memory_obj``."""
        rows = self._rows(kwargs)
        if end > rows.shape[0]:
            raise ValueError(f"tokens [{start}, {end}) but only {rows.shape[0]} rows")
        src = rows[start:end].reshape(end - start, 2, self.half).transpose(0, 1)  # [2, n, w]
        self._object_tensor(memory_obj, end - start)[:, 0].copy_(src)

    @torch.inference_mode()
    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        """Copy ``memory_obj`` into the rows of tokens ``[start, end)`` (those before the
        ``skip_tokens`` kwarg are left alone)."""
        rows = self._rows(kwargs)
        first = max(start, int(kwargs.get("skip_tokens", 0)))
        if first >= end:
            return
        src = self._object_tensor(memory_obj, end - start)[:, 0, first - start:]  # [2, k, w]
        rows[first:end] = src.transpose(0, 1).reshape(end - first, self.row_width).to(rows.dtype)

    def batched_from_gpu(self, memory_objs: Any, starts: list[int], ends: list[int],
                         **kwargs: Any) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(memory_obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs: Any = None, starts: list[int] | None = None,
                       ends: list[int] | None = None, **kwargs: Any) -> None:
        assert memory_objs is not None and starts is not None and ends is not None
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(memory_obj, start, end, **kwargs)
