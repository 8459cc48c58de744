"""KV handoff between a prefill and a decode worker through LMCache (Redis or ``lm://`` backend).

One ``KVStore`` per worker process wraps one LMCache engine whose remote backend is the shared
store, and our ``BlockConnector`` (worker/lmcache_connector.py) that moves whole KV blocks of
the engine's layout (any family: ``engine.models.family.KVLayout``) by block table. Both sides
must build it from identical model name, engine layout and chunk size (``layout_fingerprint`` is
what the router compares) and pass identical token lists: LMCache keys are a prefix-hash chain
over ``chunk_size``-token chunks. Only whole blocks are stored: a prompt's last partial block is
recomputed by the decode side, like anything the store lacks. A layout that keeps state beside
its blocks (V4's window snapshots) has it stored once per resume point under its own Redis key
(worker/resume_points.py); a prefix then counts as stored up to its last block end that has one.

The prefill side calls ``put`` (LMCache writes to Redis in the background) and then
``wait_visible`` (worker/store_visibility.py), so the router is told "KV ready" only once a decode worker can read it.
The decode side calls ``fetch`` off the engine thread (the longest stored prefix, whole chunks,
the last one possibly partial, and its resume point, into host memory) and the engine copies that
into the sequence's blocks a slice per step (engine/kv_import_job.py); ``retrieve`` moves blocks
only, in one call. Either says how many leading tokens it filled; the caller recomputes the rest.

Locking: calls into LMCache's engine (``put``, ``retrieve``; on ``lm://`` also lookups and
fetches) run under one lock. On Redis, ``lookup`` and ``fetch`` never enter LMCache's engine
(worker/staged_fetch.py reads chunks in parallel into host staging): no lock, so fetches overlap.

Access and expiry. The URL may carry a password (``redis://:pw@host:port``) and TLS
(``rediss://``, ``?ssl_ca_certs=PATH`` for a private CA); both are checked with a PING at
start-up, and the password never reaches a log: our messages use ``redact_url`` and LMCache's
own loggers (which print the URL at INFO) get a ``RedactingFilter``. On a Redis store every
chunk key is written with a TTL (``ttl_s``; LMCache's SETs go through ``ExpiringRedis``), and a
``put`` that reuses stored chunks refreshes theirs, so KV left by a request that never finished
(a cancelled or failed split, a prefill worker killed mid-store) expires instead of staying
forever. Nothing deletes chunks when a request fails: chunks are content-addressed and shared
by every prompt with the same prefix, so the chunks of a failed request may be the live prefix of
another one; the TTL is the only safe bound. ``lm://`` stores have no TTL.

This module never decides what to recompute and never frees engine blocks: that is the engine's
and the workers' business. Processes using it must run with ``PYTHONHASHSEED=0`` and
``LMCACHE_TRACK_USAGE=false`` (``kv_store_config.worker_environment()`` gives both).
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Sequence
from typing import Any

import torch

from common.redact import public_url
from engine.models.family import KVLayout
from engine.staged_kv import StagedKV
from worker import store_visibility
from worker.host_staging import ARENA_WAIT_S, HostStaging
from worker.kv_store_config import KVStoreConfig, KVStoreError
from worker.lmcache_engine import build_lmcache_engine, lmcache_pool_gb
from worker.lmcache_redis import (
    avoid_redis_close_deadlock,
    expire_on_write,
    redact_lmcache_logs,
    refresh_ttl,
)
from worker.redis_chunk_reader import RedisChunkReader
from worker.resume_points import ResumePoints
from worker.staged_fetch import fetch_staged, staged_blocks, stored_chunks
from worker.store_reach import check_reachable, redis_client

log = logging.getLogger(__name__)


class KVStore:
    """LMCache engine + block connector for one worker process. Thread-safe. ``writes=False``
    for a process that never puts (its LMCache pool is then small: lmcache_pool_gb)."""

    def __init__(
        self,
        url: str,
        model_name: str,
        layout: KVLayout,
        chunk_size: int = 256,
        *,
        staging_gb: float = 0.5,
        blocking_timeout_s: int = 10,
        ttl_s: int = 3600,
        writes: bool = True,
        pin_staging: bool = False,
        fetch_connections: int = 4,
    ) -> None:
        self.config = KVStoreConfig(
            url=url,
            model_name=model_name,
            engine_layout=layout.fingerprint,
            block_size=layout.block_size,
            bytes_per_block=layout.bytes_per_block,
            chunk_size=chunk_size,
            staging_gb=staging_gb,
            blocking_timeout_s=blocking_timeout_s,
            ttl_s=ttl_s,
        )
        self.layout = layout
        if os.environ.get("PYTHONHASHSEED") != "0":
            # LMCache keys chunks with Python's hash() over token tuples and asks every process
            # for the same seed (int tuples hash alike anyway today; a key that mixed in a str
            # would not, and every handoff would silently become a recompute).
            log.warning("PYTHONHASHSEED is not 0 in this process: LMCache keys may not match "
                        "a peer's; start workers with worker.kv_store_config.worker_environment()")
        os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
        check_reachable(self.config.url)
        self._redis = redis_client(self.config.url)  # None for lm://
        self._reader = None if self._redis is None else RedisChunkReader(
            self.config.url, num_connections=fetch_connections,
            timeout_s=self.config.blocking_timeout_s)
        self._lock = threading.Lock()
        self._staging = HostStaging(int(self.config.staging_gb * 2**30), pin=pin_staging)
        # LMCache's CPU pool, zero-filled at start (the fetch arena is touched only when used)
        self.pool_bytes = int(lmcache_pool_gb(self.config, writes) * 2**30)
        self._instance_id = f"bulkhead-{uuid.uuid4().hex[:12]}"
        redact_lmcache_logs()
        try:
            self._engine = build_lmcache_engine(self.config, self._instance_id, writes)
        except BaseException:
            if self._redis is not None:
                self._redis.close()
                self._reader.close()
            raise
        redact_lmcache_logs()  # loggers of modules the build imported
        self._closed = False
        self.resume_bytes_sent = 0  # resume-point bytes this store has sent (benchmarks)
        self._resume: ResumePoints | None = None
        if layout.resume_state_bytes:
            self._resume = ResumePoints(self._redis, self.config.layout_fingerprint,
                                        layout.block_size, layout.resume_state_bytes, ttl_s)
            if self._redis is None:
                log.warning("KV store %s is not Redis: it has no place for this layout's resume "
                            "points, so nothing it stores can be resumed (decode recomputes)",
                            self.public_url)
        wants_ttl = self._redis is not None and self.config.ttl_s > 0
        if wants_ttl and not expire_on_write(self._engine, self.config.ttl_s):
            self.close()
            raise KVStoreError("cannot give LMCache's Redis writes a TTL (its connector "
                               "changed?); set kv_ttl_s=0 to run without expiry")

    # ------------------------------------------------------------------ properties
    @property
    def layout_fingerprint(self) -> str:
        return self.config.layout_fingerprint

    @property
    def chunk_size(self) -> int:
        return self.config.chunk_size

    @property
    def public_url(self) -> str:
        return public_url(self.config.url)

    # ------------------------------------------------------------------ operations
    def stored_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """The leading tokens the store keeps: whole blocks only."""
        n = len(token_ids) // self.config.block_size * self.config.block_size
        return self._tokens(token_ids[:n])

    def put(self, token_ids: Sequence[int], kv_data: Any, block_ids: Sequence[int]) -> None:
        """Copy the KV of ``token_ids``' whole blocks (``block_ids`` of the engine's storage
        ``kv_data``, in ``self.layout``) into LMCache. Returns once the bytes are copied out of
        ``kv_data`` (the blocks may be freed then); the remote write goes on in LMCache's
        background loop: use ``wait_visible``."""
        tokens = self.stored_prefix(token_ids)
        if not tokens:
            return
        # Chunks a peer already stored (a shared system prompt) are not sent again.
        present = self._stored_blocks(tokens)
        with self._lock:
            self._check_open()
            if present:  # reused chunks live on as long as prompts keep reusing them
                refresh_ttl(self._redis, [k for _, e, k in self._chunk_keys(tokens) if e <= present],
                            self.config.ttl_s, self.public_url)
            if present < len(tokens):
                skip = present - present % self.config.chunk_size
                mask = torch.ones(len(tokens), dtype=torch.bool)
                mask[:skip] = False
                self._engine.store(tokens, mask=mask, kv_data=kv_data, layout=self.layout,
                                   block_ids=list(block_ids))
            if self._resume is not None:  # synchronous: visible when put returns
                self.resume_bytes_sent += self._resume.put(tokens, kv_data, block_ids,
                                                           self.layout)

    def wait_visible(self, token_ids: Sequence[int], timeout_s: float,
                     stall_s: float | None = None) -> int:
        """Poll the store until it holds KV for all of ``token_ids``' whole blocks, ``timeout_s``
        passes or (``stall_s``) nothing new showed for that long (LMCache only logs a dropped
        write); returns the leading tokens a peer can load (up to its last resume point)."""
        tokens = self.stored_prefix(token_ids)
        visible = store_visibility.wait_visible(lambda: self._stored_blocks(tokens), len(tokens),
                                                self.reachable, timeout_s, stall_s,
                                                self.public_url)
        return self._resumable(tokens, visible)

    def reachable(self, timeout_s: float = 0.2) -> bool:
        """A cheap TCP probe of the store (no LMCache call)."""
        try:
            check_reachable(self.config.url, timeout_s)
        except KVStoreError:
            return False
        return True

    def store(self, token_ids: Sequence[int], kv_data: Any, block_ids: Sequence[int],
              timeout_s: float = 10.0) -> int:  # put, then the leading tokens a peer can load
        self.put(token_ids, kv_data, block_ids)
        return self.wait_visible(token_ids, timeout_s)

    def lookup(self, token_ids: Sequence[int]) -> int:
        """Number of leading tokens of ``token_ids`` a peer can load and continue from: whole
        blocks the remote backend holds, up to the last one whose end is a stored resume point
        (every block end, for a layout that keeps nothing beside its blocks)."""
        tokens = self.stored_prefix(token_ids)
        return self._resumable(tokens, self._stored_blocks(tokens))

    def _stored_blocks(self, tokens: list[int]) -> int:
        """Leading tokens of the block-aligned ``tokens`` whose blocks LMCache holds."""
        if not tokens:
            return 0
        if self._reader is not None:  # no LMCache state: never waits behind a fetch or a put
            self._check_open()
            present = stored_chunks(self._reader, self.config, self._chunk_keys(tokens))
            return present[-1][1] if present else 0
        with self._lock:
            self._check_open()
            return int(self._engine.lookup(tokens, search_range=["RemoteBackend"]))

    def _resumable(self, tokens: list[int], stored: int) -> int:
        if not self.layout.resume_state_bytes:
            return stored
        if self._resume is None:
            return 0
        ends = self._resume.stored_ends(tokens, stored)
        return ends[0][0] if ends else 0

    def retrieve(
        self,
        token_ids: Sequence[int],
        kv_data: Any,
        block_ids: Sequence[int],
        skip_tokens: int = 0,
        layout: Any = None,
    ) -> int:
        """Load the longest stored prefix of ``token_ids`` into ``block_ids`` of ``kv_data``
        (the engine's storage in ``self.layout``, or another ``layout`` such as HostBlocks).

        Returns the number of leading tokens filled: possibly fewer than asked (a chunk missing
        or evicted), never a gap. Tokens past the returned count are untouched or must be
        recomputed by the caller. The first ``skip_tokens`` tokens are never written (the engine
        already holds them, maybe in blocks shared with other sequences); whole chunks among
        them are not even fetched.
        """
        tokens = self.stored_prefix(token_ids)
        if not tokens:
            return 0
        chunk = self.config.chunk_size
        skip_fetch = min(skip_tokens, len(tokens)) // chunk * chunk
        mask = None
        if skip_fetch:
            mask = torch.ones(len(tokens), dtype=torch.bool)
            mask[:skip_fetch] = False
        with self._lock:
            self._check_open()
            got = self._engine.retrieve(tokens, mask=mask, kv_data=kv_data,
                                        layout=layout or self.layout, block_ids=list(block_ids),
                                        skip_tokens=skip_tokens)
        return skip_fetch + _leading_true(got[skip_fetch:])

    def fetch(self, token_ids: Sequence[int]) -> tuple[int, StagedKV | None]:
        """Load the longest stored prefix of ``token_ids`` that a sequence can continue from
        into host memory, off the engine thread; the engine (or ``import_staged``) then copies
        it into the engine's blocks.

        Returns ``(num_tokens, staged)``: the prefix's blocks (whole chunks up to its resume
        point) and, for a layout that keeps state beside its blocks, that point's state;
        ``(0, None)`` when nothing usable is stored. Host memory only: the device plan is
        untouched."""
        from worker.lmcache_connector import HostBlocks

        tokens = self.stored_prefix(token_ids)
        stored = self._stored_blocks(tokens)
        ends: list[tuple[int, str]] = []
        if self.layout.resume_state_bytes and self._resume is not None:
            ends = self._resume.stored_ends(tokens, stored)
            target = ends[0][0] if ends else 0
        else:
            target = 0 if self.layout.resume_state_bytes else stored
        if not target:
            return 0, None
        cfg = self.config
        # whole chunks (their keys are those of the full prompt's chain) up to the resume point
        tokens = tokens[:min(len(tokens), -(-target // cfg.chunk_size) * cfg.chunk_size)]
        wait_s = ARENA_WAIT_S  # room in the host arena: another prompt's fetch + import
        if self._reader is not None:  # Redis: parallel reads into host staging, lock-free
            self._check_open()
            loaded, blocks, region = fetch_staged(self._reader, cfg, self._chunk_keys(tokens),
                                                  self._staging, wait_s)
        else:
            tokens, blocks, region = staged_blocks(self._staging, cfg, tokens, wait_s)
            loaded = 0 if blocks is None else self.retrieve(
                tokens, blocks, list(range(blocks.shape[0])), layout=HostBlocks)
        if not loaded:  # nothing stored, or no room in the host staging in time: recompute
            return 0, None
        if not self.layout.resume_state_bytes:
            return loaded, StagedKV(blocks, loaded, region=region)
        assert self._resume is not None
        for end, key in ends:  # the longest loaded one whose state is still there
            state = self._resume.get(key) if end <= loaded else None
            if state is not None:
                return end, StagedKV(blocks, end, end, state, region=region)
        return 0, None

    def import_staged(self, kv_data: Any, block_ids: Sequence[int], staged: StagedKV,
                      start: int, end: int) -> None:
        """Copy the fetched blocks of tokens ``[start, end)`` (block-aligned) into ``block_ids``
        of ``kv_data`` at once, then the resume point's state if it ends there: the engine's
        own import (engine/kv_import_job.py) run to its end, a chunk of blocks per copy. For
        benches and tests; a serving engine spreads the same copies over its steps."""
        from engine.kv_import_job import SlicedImport
        from engine.scheduler import KVLoad

        load = KVLoad("import_staged", tuple(block_ids), end, start, end)
        job = SlicedImport(staged, self.layout, kv_data, load, None)
        while not job.done:
            job.advance(self.config.chunk_size // self.config.block_size)

    def chunk_keys(self, token_ids: Sequence[int]) -> list[tuple[int, int, str]]:
        """``(start, end, key)`` of each chunk of ``token_ids``; a Redis backend stores
        ``key + "kv_bytes"`` and ``key + "metadata"`` for each (for eviction and diagnostics)."""
        return self._chunk_keys(self._tokens(token_ids))

    def _chunk_keys(self, tokens: list[int]) -> list[tuple[int, int, str]]:
        db = self._engine.token_database
        return [(s, e, k.to_string()) for s, e, k in db.process_tokens(tokens)]

    def close(self) -> None:
        """Stop LMCache's threads and drop its connections. Idempotent."""
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        with self._lock:
            if self._closed:
                return
            self._closed = True
            avoid_redis_close_deadlock(self._engine)
            # LMCache's threads are not daemons: a close that hangs would keep the worker
            # process alive forever, so it gets a bounded time and is then abandoned.
            closer = threading.Thread(
                target=LMCacheEngineBuilder.destroy, args=(self._instance_id,), daemon=True
            )
            closer.start()
            closer.join(timeout=10.0)
            if closer.is_alive():
                log.error("LMCache did not close within 10 s; abandoning its threads")
            if self._redis is not None:
                self._redis.close()
                self._reader.close()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers
    def _check_open(self) -> None:
        if self._closed:
            raise KVStoreError("KV store is closed")

    @staticmethod
    def _tokens(token_ids: Sequence[int]) -> list[int]:
        # Always a plain list of ints: LMCache hashes chunks of whatever it is given, and both
        # sides must hash the same thing.
        return [int(t) for t in token_ids]


def _leading_true(mask: torch.Tensor) -> int:
    if mask.numel() == 0 or not bool(mask[0]):
        return 0
    falses = (~mask.bool()).nonzero()
    return int(falses[0, 0]) if falses.numel() else int(mask.numel())
