"""Adapter from the engine's family contract (``forward(batch, kv, ws)``, ``compute_logits``) to
DeepSeek-V4: owns the model and its per-slot cache state, resets a slot when a sequence starts
in it, and refuses a step whose positions disagree with what the slot holds (V4's compressor
state cannot be rebuilt from a prefix cache or rewound, so such a step is a scheduling bug).

Never allocates cache memory after construction; the paged KVCache argument is unused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from engine.errors import InvalidRequest
from engine.models.deepseek_v4.backend import V4Backend
from engine.models.deepseek_v4.cache_state import DeepseekV4CacheState
from engine.models.deepseek_v4.config import DeepseekV4Config
from engine.models.deepseek_v4.model import DeepseekV4Model
from engine.models.deepseek_v4.state_rows import DeepseekV4StateRows


class DeepseekV4Runner:
    def __init__(
        self, hf_config: Mapping[str, Any], state_dict: Mapping[str, torch.Tensor], *,
        max_batch: int, max_context: int, dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu", backend: V4Backend | None = None,
        weight_format: str = "checkpoint",
    ) -> None:
        self.cfg = DeepseekV4Config.from_hf_dict(dict(hf_config))
        # the engine hands its weights dict over: experts leave it as they are stacked
        self.model = DeepseekV4Model.from_state_dict(self.cfg, state_dict, dtype, device, backend,
                                                     weight_format, consume=True)
        self.cache = DeepseekV4CacheState(self.cfg, max_batch, max_context, dtype, device)
        # per-slot state export/import as per-token rows (the engine's ``slot_state`` hook)
        self.slot_state = DeepseekV4StateRows.for_model(self.cache, self.model)

    def forward(self, batch: Any, kv: object | None = None, ws: object | None = None) -> torch.Tensor:
        """``batch``: an engine StepBatch (input_ids, positions, query_start_loc, context_lens,
        cache_slots). Returns hidden [N, hidden]."""
        del kv
        for i, slot in enumerate(batch.cache_slots):
            start = batch.context_lens[i] - (batch.query_start_loc[i + 1] - batch.query_start_loc[i])
            if start == 0:
                self.cache.reset_slot(slot)
            elif self.cache.num_tokens[slot] != start:
                raise InvalidRequest(
                    f"deepseek_v4 slot {slot} holds {self.cache.num_tokens[slot]} tokens but the step "
                    f"continues at position {start}; V4 state cannot be rewound or prefix-cached",
                    field="cache_slots",
                )
        return self.model(batch.input_ids, batch.positions, batch.query_start_loc, batch.cache_slots,
                          self.cache, ws)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.model.compute_logits(hidden, out)
