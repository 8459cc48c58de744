"""Which workers exist, whether they answer, and how loaded they are.

`WorkerRegistry` is the small interface the rest of the router uses; `StaticRegistry` serves a
fixed list of addresses (flags / env) and polls each worker's GetInfo on start-up and every
`poll_interval_s`.  A Redis-backed registry with heartbeats can implement the same interface.
A worker whose reported role differs from its configured one is refused, and a prefill/decode
pair whose Compatibility messages differ is never paired (the policy compares `compat_key`); both
are logged once with the field that differs.  This module must never block a request on a poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from proto import bulkhead_pb2 as pb
from router.errors import WorkerCallError
from router.policy import CompatKey, WorkerLoad
from router.worker_client import CallDeadlines, WorkerClient

log = logging.getLogger("bulkhead.router.registry")

COMPAT_FIELDS = ("model_fingerprint", "tokenizer_fingerprint", "dtype", "block_size",
                 "lmcache_chunk_size", "kv_layout_fingerprint")


def compat_key(compat: pb.Compatibility) -> CompatKey:
    return (compat.model_fingerprint, compat.tokenizer_fingerprint, compat.dtype,
            int(compat.block_size), int(compat.lmcache_chunk_size), compat.kv_layout_fingerprint)


def compat_diff(a: pb.Compatibility, b: pb.Compatibility) -> list[str]:
    """Fields that differ, as 'field: a != b'."""
    return [f"{name}: {getattr(a, name)!r} != {getattr(b, name)!r}"
            for name in COMPAT_FIELDS if getattr(a, name) != getattr(b, name)]


class WorkerRegistry(Protocol):
    """What the router needs of a worker registry."""

    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    async def refresh(self) -> None: ...
    def loads(self) -> list[WorkerLoad]: ...
    def info(self, address: str) -> pb.WorkerInfo | None: ...
    def client(self, address: str) -> WorkerClient: ...
    def track(self, address: str) -> contextlib.AbstractContextManager[None]: ...
    def problems(self) -> dict[str, str]: ...
    def mark_unavailable(self, address: str, problem: str) -> None: ...


MAX_MISSED_POLLS = 3  # consecutive GetInfo deadlines before a worker is taken out of routing


@dataclass
class _Worker:
    address: str
    role: str
    client: WorkerClient
    info: pb.WorkerInfo | None = None
    healthy: bool = False
    problem: str = "not polled yet"
    num_inflight: int = 0
    missed_polls: int = 0  # consecutive GetInfo deadlines while otherwise healthy


@dataclass
class StaticRegistry:
    """Workers given by address; load and health from periodic GetInfo polls."""

    prefill_addresses: Sequence[str]
    decode_addresses: Sequence[str]
    deadlines: CallDeadlines
    poll_interval_s: float = 2.0
    _workers: dict[str, _Worker] = field(default_factory=dict, init=False)
    _task: asyncio.Task[None] | None = field(default=None, init=False)
    _logged: set[str] = field(default_factory=set, init=False)

    def __post_init__(self) -> None:
        for role, addrs in (("prefill", self.prefill_addresses), ("decode", self.decode_addresses)):
            for addr in addrs:
                if addr in self._workers:
                    raise ValueError(f"worker address {addr} is listed twice")
                self._workers[addr] = _Worker(addr, role, WorkerClient(addr, self.deadlines))

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.get_running_loop().create_task(self._poll_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for w in self._workers.values():
            await w.client.close()

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            try:
                await self.refresh()
            except Exception:  # a poll bug must not stop future polls
                log.exception("worker poll failed")

    async def refresh(self) -> None:
        """Poll every worker's GetInfo concurrently and re-check compatibility."""
        workers = list(self._workers.values())
        results = await asyncio.gather(*(w.client.get_info() for w in workers),
                                       return_exceptions=True)
        for w, res in zip(workers, results, strict=True):
            if (isinstance(res, WorkerCallError) and res.code == grpc.StatusCode.DEADLINE_EXCEEDED
                    and w.healthy and w.missed_polls + 1 < MAX_MISSED_POLLS):
                # A slow answer is not a dead worker: a busy host (a long prefill step on
                # few cores) can miss one poll. A refused connection still counts at once.
                w.missed_polls += 1
                log.info("worker %s (%s) missed a GetInfo deadline (%d in a row)", w.address,
                         w.role, w.missed_polls)
                continue
            w.missed_polls = 0
            if isinstance(res, WorkerCallError):
                self._set_problem(w, f"GetInfo failed: {res.code.name} {res.details}")
            elif isinstance(res, BaseException):
                self._set_problem(w, f"GetInfo failed: {res!r}")
            elif res.role != w.role:
                self._set_problem(w, f"reports role {res.role!r}, configured as {w.role!r}")
                w.info = res
            else:
                if not w.healthy:
                    log.info("worker %s (%s) is up: max_context=%d max_batch=%d", w.address,
                             w.role, res.max_context, res.max_batch)
                w.info, w.healthy, w.problem = res, True, ""
        self._check_pairs()

    def _set_problem(self, w: _Worker, problem: str) -> None:
        if w.healthy or w.problem != problem:
            log.warning("worker %s (%s) refused: %s", w.address, w.role, problem)
        w.healthy, w.problem = False, problem

    def _check_pairs(self) -> None:
        up = [w for w in self._workers.values() if w.healthy and w.info is not None]
        for p in (w for w in up if w.role == "prefill"):
            for d in (w for w in up if w.role == "decode"):
                assert p.info is not None and d.info is not None
                diff = compat_diff(p.info.compat, d.info.compat)
                line = f"prefill {p.address} / decode {d.address} incompatible: {'; '.join(diff)}"
                if diff and line not in self._logged:
                    self._logged.add(line)
                    log.warning("%s; this pair is never used for a KV handoff", line)

    def problems(self) -> dict[str, str]:
        return {w.address: w.problem for w in self._workers.values() if not w.healthy}

    def loads(self) -> list[WorkerLoad]:
        out = []
        for w in self._workers.values():
            info = w.info
            if info is None:
                continue
            out.append(WorkerLoad(
                address=w.address, role=w.role, max_context=int(info.max_context),
                max_batch=int(info.max_batch), max_queue=int(info.max_queue),
                num_running=int(info.num_running), num_waiting=int(info.num_waiting),
                num_inflight=w.num_inflight, free_kv_tokens=int(info.free_kv_tokens),
                compat_key=compat_key(info.compat), healthy=w.healthy))
        return out

    def info(self, address: str) -> pb.WorkerInfo | None:
        return self._workers[address].info

    def client(self, address: str) -> WorkerClient:
        return self._workers[address].client

    def mark_unavailable(self, address: str, problem: str) -> None:
        """A call failed with UNAVAILABLE: stop routing there until the next good poll."""
        self._set_problem(self._workers[address], problem)

    @contextlib.contextmanager
    def track(self, address: str) -> Iterator[None]:
        """Count a request in flight on `address` for the duration of the block."""
        w = self._workers[address]
        w.num_inflight += 1
        try:
            yield
        finally:
            w.num_inflight -= 1
