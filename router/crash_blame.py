"""Which request to blame when a worker process dies under it.

A worker that dies (SIGKILL, a segfault, its engine loop failing) breaks every call it was
running. The router then must not replay those requests on the next worker: one of them may be
what killed it (issue 39: one request took down the prefill worker, then the decode worker it
was handed to). So a call cut by a crash (`is_crash`) is answered with `WorkerCrashed` and never
retried elsewhere, and the request that is to blame is quarantined (router/quarantine.py).

Blame is given honestly, from what the router saw: the requests running on that worker when the
first of its calls broke are the suspects (counted by fingerprint, so the n choices of one
request are one suspect). A request is to blame when it was the only suspect, or when it is a
suspect for the second time within `window_s` (two crashes with it on board). A bystander of
one crash is answered 503 and may be retried by its client.

Plain data and a clock: no sockets, no asyncio. State is this router's (the quarantine itself
is shared through Redis; the suspect counts are not).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from router.errors import WorkerCallError

# What grpc reports for a call whose worker went away mid-call (measured on grpcio with a
# SIGKILLed server: "Socket closed"; resets and GOAWAYs read the others), and what a worker says
# when its engine loop died under the call (worker/engine_loop.py's EngineLoopFailed). A worker
# that could not be reached at all reads "failed to connect to all addresses": not a crash.
_CRASH_SIGNS = ("socket closed", "connection reset", "broken pipe", "stream removed", "goaway",
                "engine loop failed")


def is_crash(err: WorkerCallError) -> bool:
    """Whether ``err`` says the worker died while it ran the call: its handler had taken the
    call (it sent proto's ACCEPTED) and the connection was lost after. Not a worker never
    reached, nor a request sent on a connection whose worker had already died (the first
    chat after a SIGKILL reads "Connection reset by peer" without ACCEPTED), nor a stall."""
    details = err.details.lower()
    return (err.reached and err.code == grpc.StatusCode.UNAVAILABLE
            and any(sign in details for sign in _CRASH_SIGNS))


class WorkerCrashed(Exception):
    """The worker died while running this request, and the request is not to blame (yet); it
    is not retried on another worker. Mapped to HTTP 503 at the edge."""

    def __init__(self, err: WorkerCallError, num_suspects: int) -> None:
        others = num_suspects - 1
        super().__init__(
            f"the worker running this request ({err.phase} on {err.address}) died while "
            f"running it ({err.details}), with {others} other request(s) running there. It is "
            "not retried on another worker, since a request that crashes one worker can crash "
            "the next; retry later (the same request at a second worker crash is quarantined)")
        self.err = err


@dataclass(frozen=True)
class Ticket:
    """One call of one request running on one worker."""

    address: str
    generation: int   # the worker's generation when the call began (a crash starts the next)
    fingerprint: str
    id: int


@dataclass(frozen=True)
class Verdict:
    blamed: bool
    num_suspects: int     # distinct requests running on the worker when it died
    num_crashes: int      # crashes this request was a suspect of, within the window


@dataclass
class _Crash:
    at: float
    suspects: frozenset[str]
    counted: set[str] = field(default_factory=set)


@dataclass
class CrashBlame:
    window_s: float = 600.0
    clock: Callable[[], float] = time.monotonic
    _generation: dict[str, int] = field(default_factory=dict)
    _running: dict[tuple[str, int], dict[int, str]] = field(default_factory=dict)
    _crashes: dict[tuple[str, int], _Crash] = field(default_factory=dict)
    _suspected: dict[str, list[float]] = field(default_factory=dict)
    _ids: itertools.count = field(default_factory=itertools.count)

    def begin(self, address: str, fingerprint: str) -> Ticket:
        """A call of the request ``fingerprint`` starts on ``address``; `end` it in a finally."""
        t = Ticket(address, self._generation.get(address, 0), fingerprint, next(self._ids))
        self._running.setdefault((address, t.generation), {})[t.id] = fingerprint
        return t

    def end(self, ticket: Ticket) -> None:
        key = (ticket.address, ticket.generation)
        running = self._running.get(key)
        if running is not None:
            running.pop(ticket.id, None)
            if not running:
                del self._running[key]

    def crashed(self, ticket: Ticket) -> Verdict:
        """``ticket``'s call was cut by its worker's death: is its request to blame?"""
        now = self.clock()
        self._forget_before(now - self.window_s)
        key = (ticket.address, ticket.generation)
        crash = self._crashes.get(key)
        if crash is None:
            # the first call of this crash to report it: who was running there now is the
            # suspect list of this crash; later calls begin under the next generation
            suspects = frozenset(self._running.get(key, {}).values()) | {ticket.fingerprint}
            crash = self._crashes[key] = _Crash(now, suspects)
            self._generation[ticket.address] = ticket.generation + 1
        times = self._suspected.setdefault(ticket.fingerprint, [])
        if ticket.fingerprint not in crash.counted:
            crash.counted.add(ticket.fingerprint)
            times.append(now)
        return Verdict(blamed=len(crash.suspects) == 1 or len(times) >= 2,
                       num_suspects=len(crash.suspects), num_crashes=len(times))

    def _forget_before(self, horizon: float) -> None:
        for key in [k for k, c in self._crashes.items() if c.at < horizon]:
            del self._crashes[key]
        for fp in list(self._suspected):
            kept = [t for t in self._suspected[fp] if t >= horizon]
            if kept:
                self._suspected[fp] = kept
            else:
                del self._suspected[fp]
