"""Loading a prompt's stored KV: fetch its whole blocks from the store into host memory on a
worker thread and hand the engine what was fetched (``StagedKV``); the engine copies it into
the sequence's blocks a bounded slice per step (engine/kv_import_job.py), whatever the family
keeps in them.

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

from engine.staged_kv import StagedKV
from worker.kv_store import KVStore

log = logging.getLogger(__name__)


async def fetch_import(store: KVStore | None, prompt: Sequence[int]) -> StagedKV | None:
    """Fetch the longest stored prefix of ``prompt`` now, off the asyncio loop, into the store's
    host staging; the engine thread (and every other stream) never waits on the network. None
    when there is no store, nothing stored, or the fetch failed."""
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
    log.info("KV fetch: %d of %d prompt tokens (%.1f MiB) in %.3f s", loaded, len(prompt),
             staged.nbytes / 2**20, time.monotonic() - started)
    return staged
