"""Rows of fixed width addressed by block (or slab) and row: the storage unit of the V4 pool.

Model dtype, or FP8 e4m3 with one fp32 scale per row. Allocates only at construction; reads
gather into new tensors of the step.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


class PagedRows:
    """``[num_blocks, rows, dim]`` rows, addressed flat as ``block * rows + i``; model dtype, or
    FP8 with a per-row fp32 scale."""

    def __init__(self, num_blocks: int, rows: int, dim: int, dtype: torch.dtype, fp8: bool,
                 device: torch.device) -> None:
        self.rows, self.dim, self.dtype = rows, dim, dtype
        self.data = torch.zeros(num_blocks, rows, dim, dtype=FP8 if fp8 else dtype, device=device)
        self.scale = torch.zeros(num_blocks, rows, dtype=torch.float32, device=device) if fp8 else None

    @staticmethod
    def row_bytes(dim: int, dtype: torch.dtype, fp8: bool) -> int:
        return dim + 4 if fp8 else dim * torch.empty((), dtype=dtype).element_size()

    def tensors(self) -> list[torch.Tensor]:
        return [self.data] if self.scale is None else [self.data, self.scale]

    def write(self, idx: torch.Tensor, x: torch.Tensor) -> None:
        """x: [n, dim] into flat rows ``idx`` [n]."""
        flat = self.data.view(-1, self.dim)
        if self.scale is None:
            flat.index_copy_(0, idx, x.to(self.dtype))
            return
        s = x.float().abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
        # copied as bytes: not every device implements index_copy_ for float8
        flat.view(torch.uint8).index_copy_(0, idx, (x.float() / s[:, None]).to(FP8).view(torch.uint8))
        self.scale.view(-1).index_copy_(0, idx, s)

    def read(self, idx: torch.Tensor) -> torch.Tensor:
        """Rows ``idx`` [n] -> [n, dim] in the model dtype."""
        if self.scale is None:
            return self.data.view(-1, self.dim).index_select(0, idx)
        rows = self.data.view(-1, self.dim).view(torch.uint8).index_select(0, idx).view(FP8)
        return (rows.float() * self.scale.view(-1).index_select(0, idx)[:, None]).to(self.dtype)
