"""The prefill side of the KV handoff: copy a finished prefill's kept KV into the store, free
it, and wait until the remote store shows it, so the decode worker that is sent next finds it.

Only the prefill worker exports; the import side is worker/kv_import.py. A failed export never
fails the request: the reply then says fewer tokens are stored and the decode side recomputes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from engine.llm_engine import LLMEngine
from worker.kv_store import KVStore
from worker.worker_base import remaining_s

log = logging.getLogger(__name__)


def export_kept_kv(engine: LLMEngine, store: KVStore, rid: str, prompt: Sequence[int]) -> int:
    """On the engine thread: copy the whole blocks of the kept KV of ``rid`` into LMCache, then
    free the blocks. Returns the leading tokens handed to the store (whole blocks)."""
    try:
        block_ids, num_tokens = engine.kept_kv(rid)
        store.put(prompt[:num_tokens], engine.kv_cache, block_ids)
        return len(store.stored_prefix(prompt[:num_tokens]))
    except Exception as exc:  # the decode side then recomputes: slower, still right
        log.warning("prefill %s: KV export failed: %s", rid, exc)
        return 0
    finally:
        engine.release(rid)


async def wait_visible(store: KVStore, tokens: Sequence[int], timeout_s: float,
                       deadline_unix_s: float) -> int:
    """Leading tokens of ``tokens`` the remote store shows, waiting at most ``timeout_s`` and
    never past the request's deadline; off the asyncio loop."""
    left = remaining_s(deadline_unix_s)
    if left is not None:
        timeout_s = max(min(timeout_s, left), 0.0)
    return await asyncio.to_thread(store.wait_visible, list(tokens), timeout_s)
