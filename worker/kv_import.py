"""Loading a prompt's stored KV: fetch it from the store into host memory on a worker thread,
then hand the engine a hook that only copies it into the sequence's blocks (or, for a family with
per-sequence state, into its cache slot).

Both roles use it: a decode worker for a handoff or a prompt seen before, a prefill worker for a
prefix seen before. Whether to fetch at all is the caller's decision (decode_worker/
import_decision.py for the decode side). Nothing here ever fails a request: a failed fetch or
copy loads nothing and the engine computes those tokens, so the answer is right either way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from engine.kv_cache import KVCache
from engine.llm_engine import KVImport
from worker.kv_store import KVStore
from worker.paged_kv import scatter_tokens

log = logging.getLogger(__name__)


async def fetch_import(store: KVStore | None, per_slot_state: bool,
                       prompt: Sequence[int]) -> KVImport | None:
    """Fetch the longest stored prefix of ``prompt`` now, off the asyncio loop, and return the
    engine's import hook; the engine thread (and every other stream) never waits on the network.
    None when there is no store, nothing stored, or the fetch failed."""
    if store is None or not prompt:
        return None
    started = time.monotonic()
    try:
        loaded, staged = await asyncio.to_thread(store.fetch, list(prompt))
    except Exception as exc:  # the store is an optimisation; never fail the request
        log.warning("KV fetch failed, recomputing: %s", exc)
        return None
    if staged is None:
        return None
    log.debug("KV fetch: %d of %d prompt tokens in %.3f s", loaded, len(prompt),
              time.monotonic() - started)
    if per_slot_state:
        return _slot_state_import(loaded, staged)
    return _paged_import(loaded, staged)


def _paged_import(loaded: int, staged: torch.Tensor) -> KVImport:
    """The import hook of a paged family: scatter the staged tokens into the sequence's blocks."""

    def load(kv: KVCache, block_ids: list[int], num_prompt_tokens: int,
             num_computed_tokens: int = 0) -> int:
        # num_computed_tokens: what the engine's own prefix cache already holds; those
        # (possibly shared) blocks are left alone.
        n = min(loaded, num_prompt_tokens)
        try:
            scatter_tokens(kv.data, block_ids, num_computed_tokens, n, staged)
        except Exception as exc:  # never let an import take the engine thread down
            log.error("KV import into blocks failed, recomputing: %s", exc)
            return 0
        return n

    return load


def _slot_state_import(loaded: int, rows: torch.Tensor) -> KVImport:
    """The import hook of a per-slot family: rebuild the sequence's slot from the fetched host
    rows (``StateRowsStore.fetch``)."""

    def load(kv: KVCache, block_ids: list[int], num_prompt_tokens: int,
             num_computed_tokens: int = 0, *, slot_state: Any = None, cache_slot: int = -1,
             max_tokens: int | None = None) -> int:
        del kv, block_ids, num_computed_tokens  # the state lives in the slot, not in blocks
        if slot_state is None or cache_slot < 0:
            log.error("state rows import without a slot; recomputing")
            return 0
        n = min(loaded, num_prompt_tokens if max_tokens is None else max_tokens)
        try:
            return int(slot_state.import_rows(cache_slot, rows, n))
        except Exception as exc:  # never let an import take the engine thread down
            log.error("state import into slot %d failed, recomputing: %s", cache_slot, exc)
            return 0

    return load
