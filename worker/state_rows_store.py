"""The KV store variant for families with per-sequence state (DeepSeek-V4): the same LMCache
engine, keys and remote backend as ``KVStore``, but chunks hold per-token state rows
(worker/state_rows_connector.py) instead of paged K/V, and the layout fingerprint includes the
family's state layout (``slot_state.fingerprint``), so a prefill and a decode worker whose state
layouts differ never exchange bytes.

``put(tokens, rows, [])`` stores the rows of a prefix (rows: host ``[n, row_width]``);
``fetch(tokens)`` loads the longest stored prefix into a new host tensor, off the engine thread.
Like ``KVStore`` it never decides what to recompute and never touches engine state, and its
chunk keys expire after ``ttl_s`` the same way.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from worker.kv_store import KVStore

_ROWS_LAYOUT_VERSION = "bulkhead-state-rows-v1"


def rows_layout_fingerprint(model_name: str, row_width: int, dtype: torch.dtype,
                            chunk_size: int, state_fingerprint: str) -> str:
    """Hash of what decides what the stored rows mean and how they are keyed."""
    desc = "|".join(str(x) for x in (_ROWS_LAYOUT_VERSION, model_name, row_width,
                                     str(dtype).removeprefix("torch."), chunk_size,
                                     state_fingerprint))
    return hashlib.sha256(desc.encode()).hexdigest()[:16]


class StateRowsStore(KVStore):
    """LMCache engine + state-rows connector for one worker process. Thread-safe."""

    def __init__(self, url: str, model_name: str, row_width: int, dtype: torch.dtype,
                 state_fingerprint: str, chunk_size: int = 256, *, staging_gb: float = 0.5,
                 blocking_timeout_s: int = 10, ttl_s: int = 3600) -> None:
        self.row_width = row_width
        self.state_fingerprint = state_fingerprint
        # LMCache sees one virtual layer, one "head" of row_width / 2 values (K half, V half).
        super().__init__(url, model_name, 1, 1, row_width // 2, dtype, chunk_size,
                         staging_gb=staging_gb, blocking_timeout_s=blocking_timeout_s,
                         ttl_s=ttl_s)

    @classmethod
    def for_slot_state(cls, url: str, model_name: str, slot_state: Any, chunk_size: int = 256,
                       **kw: Any) -> StateRowsStore:
        """``slot_state``: the engine's per-slot export/import object (``LLMEngine.slot_state``)."""
        return cls(url, model_name, slot_state.row_width, slot_state.dtype,
                   slot_state.fingerprint, chunk_size, **kw)

    def _make_connector(self):  # noqa: ANN202 - an LMCache GPUConnectorInterface
        from worker.state_rows_connector import StateRowsConnector

        return StateRowsConnector(self.row_width)

    @property
    def layout_fingerprint(self) -> str:
        return rows_layout_fingerprint(self.config.model_name, self.row_width, self.config.dtype,
                                       self.config.chunk_size, self.state_fingerprint)

    def put_rows(self, token_ids: Sequence[int], rows: torch.Tensor) -> None:
        """Hand the rows of ``token_ids`` (host ``[>= n, row_width]``) to LMCache; returns once
        they are copied out of ``rows`` (the remote write continues: use ``wait_visible``)."""
        self.put(token_ids, rows, [])

    def fetch(self, token_ids: Sequence[int]) -> tuple[int, torch.Tensor | None]:
        """Longest stored prefix of ``token_ids`` as host rows ``[len(token_ids), row_width]``
        (rows past the returned count are garbage); ``(0, None)`` when nothing is stored."""
        tokens = self._tokens(token_ids)
        if not tokens or self.lookup(tokens) == 0:
            return 0, None
        staged = torch.zeros(len(tokens), self.row_width, dtype=self.config.dtype)
        loaded = self.retrieve(tokens, staged, [])
        return (loaded, staged) if loaded else (0, None)
