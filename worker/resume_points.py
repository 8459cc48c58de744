"""Resume points of a handoff: what a layout keeps beside its blocks (``KVLayout.
resume_state_bytes``; DeepSeek-V4's sliding-window snapshot at a block end) stored once per
block end that has one, under its own Redis key, beside the LMCache chunks of the blocks.

Why not in the blocks or in LMCache: a snapshot belongs to one block end, and only a few block
ends of a prompt have one (the last of each prefill step). Carried in every block, it would
multiply a V4-Flash handoff by 3.4 (FP8, blocks of 256: 2.84 MB of window beside 1.16 MB of
block). LMCache's chunk model does not fit it either: a chunk is a fixed number of bytes per
token on a prefix-hash chain, and a lookup counts a prefix only when every chunk before it is
stored, so a per-resume-point object would need a second LMCache engine (its own metadata,
staging pool and threads) keyed on a fake chain. One plain key per resume point in the same
Redis is one SET and one GET.

A key names the store's layout fingerprint (model, layout, block and chunk size) and the
sha256 of the token prefix that ends at the block end; it expires with the store's TTL like the
chunks, and a put that finds it present only refreshes its TTL. An ``lm://`` store has no place
for them: a layout that needs them then hands off nothing resumable (decode recomputes).
Never decides what to recompute; never touches engine blocks except through the layout.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from common.redact import redact_text

log = logging.getLogger(__name__)

KEY_PREFIX = "bulkhead-resume:"


class ResumePoints:
    """The resume points of one KV store (a Redis client, a namespace, a TTL)."""

    def __init__(self, redis: Any, namespace: str, block_size: int, state_bytes: int,
                 ttl_s: int) -> None:  # noqa: ANN401 - a redis.Redis
        self.redis, self.namespace = redis, namespace
        self.block_size, self.state_bytes, self.ttl_s = block_size, state_bytes, ttl_s

    def keys(self, tokens: Sequence[int]) -> list[tuple[int, str]]:
        """``(end, key)`` of every full block end of ``tokens``: the key of the prefix
        ``tokens[:end]`` (one incremental hash over the prompt)."""
        h = hashlib.sha256(f"{self.namespace}|".encode())
        arr = np.asarray(tokens, dtype=np.int64)
        out = []
        for end in range(self.block_size, len(arr) + 1, self.block_size):
            h.update(arr[end - self.block_size:end].tobytes())
            out.append((end, KEY_PREFIX + h.copy().hexdigest()))
        return out

    def put(self, tokens: Sequence[int], kv: Any, block_ids: Sequence[int],
            layout: Any) -> int:  # noqa: ANN401 - the engine's KV and its KVLayout
        """Store the resume state of every block end of ``tokens`` that ``layout`` keeps one
        for (those already stored get a fresh TTL). Returns the bytes sent."""
        if self.redis is None:
            return 0
        points = [(end, key) for end, key in self.keys(tokens)
                  if layout.can_resume_after(kv, block_ids[end // self.block_size - 1])]
        if not points:
            return 0
        try:
            with self.redis.pipeline(transaction=False) as pipe:
                for _, key in points:
                    pipe.exists(key)
                present = pipe.execute()
            sent = 0
            with self.redis.pipeline(transaction=False) as pipe:
                for (end, key), there in zip(points, present, strict=True):
                    if there:
                        if self.ttl_s:
                            pipe.expire(key, self.ttl_s)
                        continue
                    state = layout.export_resume_state(kv, block_ids[end // self.block_size - 1])
                    if state is None:
                        continue
                    data = state.cpu().numpy().tobytes()
                    pipe.set(key, data, ex=self.ttl_s or None)
                    sent += len(data)
                pipe.execute()
            return sent
        except Exception as exc:  # redis-py raises several types; the decode side recomputes
            log.warning("KV store: could not store %d resume points: %s", len(points),
                        redact_text(str(exc)))
            return 0

    def stored_ends(self, tokens: Sequence[int], upto: int) -> list[tuple[int, str]]:
        """``(end, key)`` of the stored resume points of ``tokens`` at ``end <= upto``, longest
        first."""
        if self.redis is None or upto < self.block_size:
            return []
        points = [(e, k) for e, k in self.keys(tokens) if e <= upto]
        try:
            with self.redis.pipeline(transaction=False) as pipe:
                for _, key in points:
                    pipe.exists(key)
                present = pipe.execute()
        except Exception as exc:  # a store that is down holds nothing we can use
            log.warning("KV store: resume point lookup failed: %s", redact_text(str(exc)))
            return []
        return [p for p, there in zip(points, present, strict=True) if there][::-1]

    def get(self, key: str) -> torch.Tensor | None:
        """The stored state ([state_bytes] uint8 on the host), or None (gone or malformed)."""
        try:
            data = self.redis.get(key)
        except Exception as exc:
            log.warning("KV store: resume point read failed: %s", redact_text(str(exc)))
            return None
        if data is None or len(data) != self.state_bytes:
            return None
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)
