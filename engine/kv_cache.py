"""The paged KV cache: one tensor allocated once at start-up, never grown.

Layout (docs/architecture.md): data[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim];
index 0 of dim 1 holds K (after RoPE), 1 holds V. Block 0 is the null block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads,
                self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * elem

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_token * self.num_blocks * self.block_size

    @property
    def layout_fingerprint(self) -> str:
        return (f"paged-kv-v1:L{self.num_layers}:H{self.num_kv_heads}:D{self.head_dim}:"
                f"B{self.block_size}:{str(self.dtype).removeprefix('torch.')}")


class KVCache:
    def __init__(self, spec: KVCacheSpec, device: torch.device | str) -> None:
        self.spec = spec
        self.data = torch.zeros(spec.shape, dtype=spec.dtype, device=device)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of layer i, each [num_blocks, block_size, num_kv_heads, head_dim]."""
        return self.data[i, 0], self.data[i, 1]

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v: [N, num_kv_heads, head_dim]; slot_mapping: [N] flat slots
        k_cache, v_cache = self.layer(layer)
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)
