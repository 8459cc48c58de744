"""The tensors of one forward step, built by the model runner from a SchedulerOutput."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # [N] int64, the scheduled tokens of all sequences, concatenated
    positions: torch.Tensor  # [N] int64
    slot_mapping: torch.Tensor  # [N] int64, flat KV slot each new token's K/V is written to
    query_start_loc: list[int]  # [B + 1] offsets of each sequence's tokens in input_ids
    context_lens: list[int]  # [B] tokens in the sequence's KV after this step
    block_tables: list[list[int]]  # [B][num_blocks_of_seq]
    cache_slots: list[int]  # [B] fixed per-sequence slot in [0, max_batch)
    logits_indices: torch.Tensor  # [num_sampled] rows of the hidden states to sample from
    # Device copies for kernels, built once per step when a kernel backend is in use:
    block_tables_t: torch.Tensor | None = None  # [B, max_blocks] int32, null-block padded
    query_start_loc_t: torch.Tensor | None = None  # [B + 1] int32
    context_lens_t: torch.Tensor | None = None  # [B] int32
    # [B] whether it is the sequence's first chunk in its slot (it may resume from its blocks)
    first_chunks: list[bool] | None = None
    # [B] int64 cache slots on the device: set by a CUDA-graph step, whose host lists
    # (cache_slots, context_lens, block_tables) are placeholders fixed at capture
    cache_slots_t: torch.Tensor | None = None
    # [B] draft tokens at the end of each sequence's chunk (a verify step, engine/spec_decode.py)
    num_draft_tokens: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def query_len(self, i: int) -> int:
        return self.query_start_loc[i + 1] - self.query_start_loc[i]

    def block_table_tensor(self, device: torch.device, width: int | None = None) -> torch.Tensor:
        """[B, width] int32, padded with the null block 0."""
        width = width or max(len(t) for t in self.block_tables)
        out = torch.zeros(self.num_seqs, width, dtype=torch.int32)
        for i, t in enumerate(self.block_tables):
            out[i, : len(t)] = torch.tensor(t[:width], dtype=torch.int32)
        return out.to(device)
