"""The paged KV cache: one tensor allocated once at start-up, never grown.

Layout (docs/architecture.md): data[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim];
index 0 of dim 1 holds K (after RoPE), 1 holds V. Block 0 is the null block.
The stored dtype is the model dtype, or FP8 e4m3fn for ``kv_dtype=fp8`` (kernels/kv_quant.py says
why one implicit scale of 1.0): writes clamp and cast, every reader upcasts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.kv_quant import KV_FP8_DTYPE, KV_FP8_SCHEME, quantize_kv


def kv_storage_dtype(kv_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype a dense cache stores for EngineConfig.kv_dtype ("auto" | "fp8")."""
    return KV_FP8_DTYPE if kv_dtype == "fp8" else model_dtype


def write_rows(flat: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """flat[slots] = rows (flat: [num_slots, ...]); 1-byte dtypes move as uint8 because
    PyTorch's CPU index_copy_ has no FP8 kernel (the bytes are the same)."""
    if flat.element_size() == 1:
        flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)
    flat.index_copy_(0, slots, rows)


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
        dtype = str(self.dtype).removeprefix("torch.")
        if self.dtype == KV_FP8_DTYPE:  # what the bytes mean includes the scaling scheme
            dtype = f"fp8-{KV_FP8_SCHEME}"
        return (f"paged-kv-v1:L{self.num_layers}:H{self.num_kv_heads}:D{self.head_dim}:"
                f"B{self.block_size}:{dtype}")


class KVCache:
    def __init__(self, spec: KVCacheSpec, device: torch.device | str) -> None:
        self.spec = spec
        self.data = torch.zeros(spec.shape, dtype=spec.dtype, device=device)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of layer i, each [num_blocks, block_size, num_kv_heads, head_dim]."""
        return self.data[i, 0], self.data[i, 1]

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v: [N, num_kv_heads, head_dim] model dtype; slot_mapping: [N] flat slots
        k_cache, v_cache = self.layer(layer)
        for cache, x in ((k_cache, k), (v_cache, v)):
            write_rows(cache.view(-1, *cache.shape[2:]), slot_mapping,
                       quantize_kv(x, cache.dtype))
