"""Workers discovered in Redis: each worker keeps its WorkerInfo under a key with a TTL
(worker/registration.py), and the router scans the key prefix every `poll_interval_s`.

`RedisRegistry` is a `StaticRegistry` whose worker set also follows Redis: a new key is a
registration, a key that expired (or that the worker deleted on a graceful stop) drops the worker.
At registration a worker is refused, with one log line naming the field that differs, when its
Compatibility differs from the reference worker of the other role (the first admitted one still
registered) or its tokenizer differs from the router's own. Admitted workers are then polled
(GetInfo) and judged like static ones, except that a slow GetInfo never counts against a worker
whose heartbeat key is alive: its heartbeat's progress counters decide (router/liveness.py).

Static addresses, when also given, are merged in: they are polled as usual and never dropped,
and a registration that claims one of their addresses is ignored. Redis being unreachable drops
nobody: the known workers keep being polled and the scan is retried. A Redis that comes back
empty (restarted, or unreachable long enough for the keys to expire) is no evidence against the
workers either: for `REREGISTER_GRACE_S` after it, a worker whose key is missing stays while its
GetInfo answers, until it publishes again. This module must never block a request on Redis and
never import torch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from common.redact import public_url
from common.worker_registry import SCAN_PATTERN, role_of_key, url_problem
from router.registry import StaticRegistry, _Worker
from router.settings import RouterSettings
from router.worker_client import CallDeadlines, WorkerAccess, WorkerClient
from router.worker_status import WorkerStatus, status_from_bytes

log = logging.getLogger("bulkhead.router.registry")

ROLES = ("prefill", "decode")
REREGISTER_GRACE_S = 60.0  # after the registry lost its keys, time for workers to publish again
_OTHER_ROLE = {"prefill": "decode", "decode": "prefill"}


@dataclass
class RedisRegistry(StaticRegistry):
    """Workers registered under `bulkhead:worker:*` in `registry_url`, plus any static ones."""

    registry_url: str = ""
    expected_tokenizer_fingerprint: str = ""   # the router's tokenizer; '' = not checked
    _redis: Any = field(default=None, init=False, repr=False)
    _redis_down: bool = field(default=False, init=False)
    _run_id: str = field(default="", init=False)          # Redis's run_id: changes on restart
    _grace_until_s: float = field(default=0.0, init=False)  # monotonic; see REREGISTER_GRACE_S
    _refused: dict[str, tuple[str, str]] = field(default_factory=dict, init=False)
    # key -> (address, reason) of registrations refused, each logged once per reason

    def __post_init__(self) -> None:
        super().__post_init__()
        problem = url_problem(self.registry_url)
        if problem:
            raise ValueError(f"registry_url: {problem}")

    async def start(self) -> None:
        log.info("discovering workers in %s", public_url(self.registry_url))
        await super().start()

    async def stop(self) -> None:
        await super().stop()
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None

    async def refresh(self) -> None:
        """Scan the registry (register, drop, refuse), then poll and judge every worker."""
        await self._scan()
        await super().refresh()

    def problems(self) -> dict[str, str]:
        out = super().problems()
        for key, (address, reason) in self._refused.items():
            out[key if not address or address in out or address in self._workers else address] \
                = f"refused at registration: {reason}"
        return out

    # ------------------------------------------------------------------ scanning
    async def _scan(self) -> None:
        try:
            found = await self._read()
        except (RedisError, OSError) as exc:
            if not self._redis_down:
                log.warning("worker registry %s unreachable; keeping the %d known workers and "
                            "retrying every %g s: %s", public_url(self.registry_url),
                            len(self._workers), self.poll_interval_s, exc)
            self._redis_down = True
            return
        if self._redis_down:
            log.info("worker registry %s reachable again", public_url(self.registry_url))
            self._grace_until_s = time.monotonic() + REREGISTER_GRACE_S
        self._redis_down = False
        self._refused = {k: v for k, v in self._refused.items() if k in found}
        self._follow_heartbeats(found)
        for key in sorted(found):  # one scan's new keys are admitted in key order
            if not any(w.key == key for w in self._workers.values()):
                self._register(key, found[key])

    async def _read(self) -> dict[str, bytes]:
        """key -> serialized WorkerInfo of every live registration."""
        if self._redis is None:  # connects lazily, on this event loop
            self._redis = aioredis.from_url(self.registry_url,
                                            socket_timeout=self.deadlines.info_s,
                                            socket_connect_timeout=self.deadlines.info_s)
        run_id = str((await self._redis.info("server")).get("run_id", ""))
        if self._run_id and run_id != self._run_id:
            log.warning("worker registry %s restarted; workers get %g s to register again",
                        public_url(self.registry_url), REREGISTER_GRACE_S)
            self._grace_until_s = time.monotonic() + REREGISTER_GRACE_S
        self._run_id = run_id
        keys = sorted({k.decode() if isinstance(k, bytes) else str(k)
                       async for k in self._redis.scan_iter(match=SCAN_PATTERN, count=256)})
        if not keys:
            return {}
        values = await self._redis.mget(keys)
        # a key that expired between SCAN and MGET reads as None: it is gone
        return {k: v for k, v in zip(keys, values, strict=True) if v is not None}

    def _follow_heartbeats(self, found: dict[str, bytes]) -> None:
        """Drop registered workers whose key is gone; refresh the others' heartbeat info."""
        for w in [w for w in self._workers.values() if w.key]:
            raw = found.get(w.key)
            info = status_from_bytes(raw) if raw is not None else None
            if raw is None and w.healthy and time.monotonic() < self._grace_until_s:
                continue  # the registry lost its keys; this worker still answers GetInfo
            if raw is None:
                log.warning("worker %s (%s) dropped: its registry key %s expired or was deleted",
                            w.address, w.role, w.key)
                self._retire(w)
            elif info is None or info.address != w.address or info.role != w.role:
                # the key now describes another process: it registers again from scratch
                log.warning("worker %s (%s) dropped: key %s now names %s", w.address, w.role,
                            w.key, "an unreadable WorkerInfo" if info is None else info.address)
                self._retire(w)
            else:
                w.heartbeat = info

    def _register(self, key: str, raw: bytes) -> None:
        info = status_from_bytes(raw)
        if info is None:
            self._refuse(key, "", key, "its value is not a serialized bulkhead.v1.WorkerInfo")
            return
        name = info.worker_id or key
        static = self._workers.get(info.address)
        if static is not None and not static.key:
            return  # configured by address: that entry is the worker; its key adds nothing
        reason = self._registration_problem(key, info)
        if reason:
            self._refuse(key, info.address, name, reason)
            return
        self._refused.pop(key, None)
        self._workers[info.address] = _Worker(info.address, info.role,
                                              WorkerClient(info.address, self.deadlines,
                                                           self.access),
                                              key=key, heartbeat=info)
        log.info("worker %s (%s) registered at %s: max_context=%d max_batch=%d", name,
                 info.role, info.address, info.max_context, info.max_batch)

    def _registration_problem(self, key: str, info: WorkerStatus) -> str:
        """Why a worker publishing `info` under `key` may not join ('' when it may)."""
        role = role_of_key(key)
        if role not in ROLES or info.role != role:
            return f"role: {info.role!r} in its WorkerInfo, {role!r} in its key"
        host, sep, port = info.address.rpartition(":")
        if not sep or not host or not port.isdigit():
            return f"address: {info.address!r} is not host:port"
        if info.address in self._workers:
            holder = self._workers[info.address].key
            return f"address: {info.address} is already registered by {holder}"
        expected = self.expected_tokenizer_fingerprint
        given = info.compat.tokenizer_fingerprint
        if expected and given and given != expected:
            return f"tokenizer_fingerprint: {given!r} != {expected!r} (the router's tokenizer)"
        ref = self._reference(_OTHER_ROLE[role])
        if ref is not None:
            ref_info = ref.last_info
            assert ref_info is not None
            diff = info.compat.diff(ref_info.compat)
            if diff:
                return f"{'; '.join(diff)} (against {ref.role} worker {ref.address})"
        return ""

    def _reference(self, role: str) -> _Worker | None:
        """The first admitted worker of `role` still here whose info is known."""
        return next((w for w in self._workers.values()
                     if w.role == role and w.last_info is not None), None)

    def _refuse(self, key: str, address: str, name: str, reason: str) -> None:
        if self._refused.get(key, ("", ""))[1] != reason:
            log.warning("worker %s refused: %s", name, reason)
        self._refused[key] = (address, reason)


def build_registry(settings: RouterSettings, deadlines: CallDeadlines,
                   tokenizer_fingerprint: str = "") -> StaticRegistry:
    """The registry `settings` describe: Redis discovery merged with the static addresses when
    `registry_url` is set, else the static addresses alone."""
    access = WorkerAccess.load(settings.internal_token, settings.worker_tls_ca_file)
    if settings.registry_url:
        return RedisRegistry(settings.prefill_workers, settings.decode_workers, deadlines,
                             settings.poll_interval_s, settings.stall_timeout_s, access,
                             registry_url=settings.registry_url,
                             expected_tokenizer_fingerprint=tokenizer_fingerprint)
    return StaticRegistry(settings.prefill_workers, settings.decode_workers, deadlines,
                          settings.poll_interval_s, settings.stall_timeout_s, access)
