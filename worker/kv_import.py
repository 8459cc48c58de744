"""Loading a prompt's stored KV: fetch its whole blocks from the store into host memory on a
worker thread, then hand the engine a hook that only copies them into the sequence's blocks
(whatever the family keeps in them: the engine's KVLayout imports them).

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

from engine.model_runner import KVImport
from worker.kv_store import KVStore
from worker.staged_kv import StagedKV

log = logging.getLogger(__name__)


async def fetch_import(store: KVStore | None, prompt: Sequence[int]) -> KVImport | None:
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
    log.info("KV fetch: %d of %d prompt tokens in %.3f s", loaded, len(prompt),
              time.monotonic() - started)
    return _block_import(store, loaded, staged)


def _block_import(store: KVStore, loaded: int, staged: StagedKV) -> KVImport:
    """The import hook: copy the fetched blocks (and resume state) into the sequence's blocks."""

    def load(kv: Any, block_ids: list[int], num_prompt_tokens: int,
             num_computed_tokens: int = 0) -> int:
        # num_computed_tokens: what the engine's own prefix cache already holds; those
        # (possibly shared) blocks are left alone.
        n = min(loaded, num_prompt_tokens)
        started = time.monotonic()
        try:
            store.import_staged(kv, block_ids, staged, num_computed_tokens, n)
        except Exception as exc:  # never let an import take the engine thread down
            log.error("KV import into blocks failed, recomputing: %s", exc)
            return 0
        # the one part of a handoff that runs on the engine thread: every running stream's
        # next token waits for it, so its time is logged
        log.info("KV import: %d tokens into blocks on the engine thread in %.1f ms",
                 max(n - num_computed_tokens, 0), 1e3 * (time.monotonic() - started))
        # a layout may resume only at some block ends (V4: those with a window snapshot)
        return store.layout.resumable_tokens(kv, block_ids, n)

    return load
