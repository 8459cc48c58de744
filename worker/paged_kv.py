"""Token <-> slot arithmetic on the engine's paged KV layout, and the one bulk copy of staged
KV into a sequence's blocks. Plain torch: no LMCache, no engine state.

Layout (docs/architecture.md): kv_data [num_layers, 2, num_blocks, block_size, num_kv_heads,
head_dim]; token ``i`` of a sequence lives at flat slot ``block_ids[i // bs] * bs + i % bs``.
Nothing here writes outside the slots of the tokens it is asked to write.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def token_slots(
    block_ids: Sequence[int], block_size: int, start: int, end: int, device: torch.device
) -> torch.Tensor:
    """Flat slot index of tokens ``[start, end)``: ``block_ids[i // bs] * bs + i % bs``."""
    last_block = (end - 1) // block_size
    if end > start and last_block >= len(block_ids):
        raise ValueError(
            f"tokens [{start}, {end}) need {last_block + 1} blocks of {block_size} tokens but "
            f"the block table has {len(block_ids)}"
        )
    positions = torch.arange(start, end, dtype=torch.long)
    table = torch.as_tensor(list(block_ids), dtype=torch.long)
    slots = table[positions // block_size] * block_size + positions % block_size
    return slots.to(device)


def scatter_tokens(kv_data: torch.Tensor, block_ids: Sequence[int], start: int, end: int,
                   staged: torch.Tensor) -> None:
    """Copy tokens ``[start, end)`` of ``staged`` into the sequence's slots of ``kv_data``.

    kv_data: [L, 2, num_blocks, block_size, H, D]; staged: [L, 2, 1, n, H, D] with n >= end
    (what ``KVStore.fetch`` returns)."""
    if end <= start:
        return
    num_layers, _, num_blocks, block_size, heads, dim = kv_data.shape
    flat = kv_data.view(num_layers, 2, num_blocks * block_size, heads * dim)
    slots = token_slots(block_ids, block_size, start, end, kv_data.device)
    src = staged[:, :, 0, start:end].reshape(num_layers, 2, end - start, heads * dim)
    flat.index_copy_(2, slots, src.to(device=flat.device, dtype=flat.dtype))
