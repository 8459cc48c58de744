"""Which workers exist, whether they answer, and how loaded they are.

`WorkerRegistry` is the small interface the rest of the router uses; `StaticRegistry` serves a
fixed list of addresses (flags / env) and polls each worker's GetInfo on start-up and every
`poll_interval_s`; `RedisRegistry` (router/redis_registry.py) adds the workers that register in
Redis with a heartbeat.  A worker whose reported role differs from its configured one is refused,
and a prefill/decode pair whose compatibility values differ is never paired (the policy
compares `Compat.key()`); both are logged once with the field that differs.  A worker that has work
but whose engine made no progress for `stall_timeout_s` is not routed to (router/liveness.py);
a slow GetInfo alone is not a dead worker.  This module must never block a request on a poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from common.periodic import Periodic
from router.errors import WorkerCallError
from router.liveness import LivenessState, Progress, judge_liveness
from router.policy import WorkerLoad
from router.worker_client import EMPTY_ANSWER, CallDeadlines, WorkerAccess, WorkerClient
from router.worker_status import WorkerStatus

log = logging.getLogger("bulkhead.router.registry")

def _latest(a: WorkerStatus | None, b: WorkerStatus | None) -> WorkerStatus | None:
    """The later of two observations of one worker: the one whose counters went further; on a
    tie the one that shows work. (A heartbeat written while the worker was idle must not hide
    the work a later GetInfo saw: frozen then, it would look idle, never stalled.)"""
    if a is None or b is None:
        return a if b is None else b

    def key(s: WorkerStatus) -> tuple[int, int, int]:
        return s.steps_completed, s.tokens_advanced, s.num_running + s.num_waiting

    return a if key(a) >= key(b) else b


def progress_of(info: WorkerStatus) -> Progress:
    return Progress(info.steps_completed, info.tokens_advanced, info.num_running,
                    info.num_waiting)


class WorkerRegistry(Protocol):
    """What the router needs of a worker registry."""

    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    async def refresh(self) -> None: ...
    def loads(self) -> list[WorkerLoad]: ...
    def info(self, address: str) -> WorkerStatus | None: ...
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
    info: WorkerStatus | None = None
    healthy: bool = False
    problem: str = "not polled yet"
    num_inflight: int = 0
    missed_polls: int = 0  # consecutive GetInfo deadlines while otherwise healthy
    key: str = ""          # its registry key; '' = configured by address
    heartbeat: WorkerStatus | None = None  # last WorkerInfo published under `key`
    liveness: LivenessState | None = None

    @property
    def last_info(self) -> WorkerStatus | None:
        return self.info if self.info is not None else self.heartbeat


@dataclass
class StaticRegistry:
    """Workers given by address; load and health from periodic GetInfo polls."""

    prefill_addresses: Sequence[str]
    decode_addresses: Sequence[str]
    deadlines: CallDeadlines
    poll_interval_s: float = 2.0
    stall_timeout_s: float = 120.0
    access: WorkerAccess = field(default_factory=WorkerAccess)  # token / TLS of every call
    _workers: dict[str, _Worker] = field(default_factory=dict, init=False)
    _retired: list[_Worker] = field(default_factory=list, init=False)  # dropped, still in use
    _polls: Periodic | None = field(default=None, init=False, repr=False)
    _logged: set[str] = field(default_factory=set, init=False)

    def __post_init__(self) -> None:
        for role, addrs in (("prefill", self.prefill_addresses), ("decode", self.decode_addresses)):
            for addr in addrs:
                if addr in self._workers:
                    raise ValueError(f"worker address {addr} is listed twice")
                self._workers[addr] = _Worker(addr, role,
                                              WorkerClient(addr, self.deadlines, self.access))

    async def start(self) -> None:
        await self.refresh()
        self._polls = Periodic(self.refresh, self.poll_interval_s, "worker poll")
        self._polls.start()

    async def stop(self) -> None:
        if self._polls is not None:
            await self._polls.stop()
            self._polls = None
        for w in [*self._workers.values(), *self._retired]:
            await w.client.close()
        self._retired.clear()

    async def refresh(self) -> None:
        """Poll every worker's GetInfo concurrently, judge its progress, re-check pairs."""
        workers = list(self._workers.values())
        results = await asyncio.gather(*(w.client.get_info() for w in workers),
                                       return_exceptions=True)
        now_s = time.monotonic()
        for w, res in zip(workers, results, strict=True):
            problem = self._poll_problem(w, res)
            self._set_health(w, problem or self._liveness_problem(w, res, now_s))
        self._check_pairs()
        await self._close_retired()

    def _poll_problem(self, w: _Worker, res: WorkerStatus | BaseException) -> str:
        """What this GetInfo answer says is wrong with `w` ('' = nothing)."""
        missed = isinstance(res, WorkerCallError) and (
            res.code == grpc.StatusCode.DEADLINE_EXCEEDED or res.details == EMPTY_ANSWER)
        if missed and w.healthy and (w.key or w.missed_polls + 1 < MAX_MISSED_POLLS):
            # A slow answer is not a dead worker: a busy host (a long prefill step on few
            # cores) can miss polls. A registered worker's live heartbeat key and its progress
            # counters speak for it; an unregistered one gets MAX_MISSED_POLLS. A refused
            # connection still counts at once.
            w.missed_polls += 1
            log.info("worker %s (%s) missed a GetInfo deadline (%d in a row)", w.address,
                     w.role, w.missed_polls)
            return ""
        w.missed_polls = 0
        if isinstance(res, WorkerCallError):
            return f"GetInfo failed: {res.code.name} {res.details}"
        if isinstance(res, BaseException):
            return f"GetInfo failed: {res!r}"
        w.info = res
        if res.role != w.role:
            return f"reports role {res.role!r}, configured as {w.role!r}"
        return ""

    def _liveness_problem(self, w: _Worker, res: WorkerStatus | BaseException,
                          now_s: float) -> str:
        """'' while `w` is idle or its progress counters advance: from this GetInfo answer, or
        when it did not come, from the heartbeat (a registered worker) or the last answer.
        Mixing the sources is safe: a stalled engine's counters are frozen in all of them."""
        seen = res if isinstance(res, WorkerStatus) else _latest(w.heartbeat, w.info)
        if seen is None:
            return ""
        verdict = judge_liveness(w.liveness, progress_of(seen), now_s, self.stall_timeout_s)
        w.liveness = verdict.state
        return verdict.problem

    def _set_health(self, w: _Worker, problem: str) -> None:
        if problem:
            self._set_problem(w, problem)
            return
        if not w.healthy:
            info = w.last_info
            assert info is not None
            log.info("worker %s (%s) is up: max_context=%d max_batch=%d tp=%d", w.address,
                     w.role, info.max_context, info.max_batch, max(info.tensor_parallel_size, 1))
        w.healthy, w.problem = True, ""

    def _set_problem(self, w: _Worker, problem: str) -> None:
        if w.healthy or w.problem != problem:
            log.warning("worker %s (%s) refused: %s", w.address, w.role, problem)
        w.healthy, w.problem = False, problem

    def _retire(self, w: _Worker) -> None:
        """Stop routing to `w`; its channel closes once no request of ours uses it."""
        del self._workers[w.address]
        w.healthy = False
        self._retired.append(w)

    async def _close_retired(self) -> None:
        done = [w for w in self._retired if w.num_inflight == 0]
        self._retired = [w for w in self._retired if w.num_inflight > 0]
        for w in done:
            await w.client.close()

    def _find(self, address: str) -> _Worker | None:
        w = self._workers.get(address)
        return w if w is not None else next(
            (r for r in reversed(self._retired) if r.address == address), None)

    def _check_pairs(self) -> None:
        up = [w for w in self._workers.values() if w.healthy and w.info is not None]
        for p in (w for w in up if w.role == "prefill"):
            for d in (w for w in up if w.role == "decode"):
                assert p.info is not None and d.info is not None
                diff = p.info.compat.diff(d.info.compat)
                line = f"prefill {p.address} / decode {d.address} incompatible: {'; '.join(diff)}"
                if diff and line not in self._logged:
                    self._logged.add(line)
                    log.warning("%s; this pair is never used for a KV handoff", line)

    def problems(self) -> dict[str, str]:
        return {w.address: w.problem for w in self._workers.values() if not w.healthy}

    def loads(self) -> list[WorkerLoad]:
        out = []
        for w in self._workers.values():
            info = w.last_info
            if info is None:
                continue
            out.append(WorkerLoad(
                address=w.address, role=w.role, max_context=info.max_context,
                max_batch=info.max_batch, max_queue=info.max_queue,
                num_running=info.num_running, num_waiting=info.num_waiting,
                num_inflight=w.num_inflight, free_kv_tokens=info.free_kv_tokens,
                compat_key=info.compat.key(), healthy=w.healthy,
                total_kv_tokens=info.total_kv_tokens, num_preemptions=info.num_preemptions,
                block_size=info.compat.block_size, dtype=info.compat.dtype,
                spec_num_drafts=info.spec_num_drafts,
                spec_num_draft_tokens=info.spec_num_draft_tokens,
                spec_num_accepted_tokens=info.spec_num_accepted_tokens,
                spec_accepted_per_pos=info.spec_accepted_per_pos))
        return out

    def info(self, address: str) -> WorkerStatus | None:
        w = self._find(address)
        return None if w is None else w.last_info

    def client(self, address: str) -> WorkerClient:
        w = self._find(address)
        if w is None:
            raise KeyError(f"no worker {address} in the registry")
        return w.client

    def mark_unavailable(self, address: str, problem: str) -> None:
        """A call failed with UNAVAILABLE: stop routing there until the next good poll."""
        w = self._workers.get(address)
        if w is not None:  # a dropped worker is already out of routing
            self._set_problem(w, problem)

    @contextlib.contextmanager
    def track(self, address: str) -> Iterator[None]:
        """Count a request in flight on `address` for the duration of the block."""
        w = self._find(address)
        if w is None:
            raise KeyError(f"no worker {address} in the registry")
        w.num_inflight += 1
        try:
            yield
        finally:
            w.num_inflight -= 1
