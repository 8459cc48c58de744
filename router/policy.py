"""Routing policy: which worker(s) run a request.  Plain data in, plain data out.

Given the prompt length, the number of prompt tokens a worker can load instead of compute, and
each worker's last reported load, `choose_route` decides between a split (prefill worker, then
decode worker) and the decode worker alone, and picks the least-loaded compatible workers.  It
never picks a worker whose plan cannot hold the request's context.

This module must never do I/O (no sockets, no clocks, no logging): it is tested as a function.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

CompatKey = tuple[str, str, str, int, int, str]


@dataclass(frozen=True)
class WorkerLoad:
    """What the policy knows about one worker (from its last GetInfo plus router-side counts)."""

    address: str
    role: str                    # "prefill" | "decode"
    max_context: int             # longest prompt + output the worker's plan holds
    max_batch: int
    max_queue: int               # 0 = unbounded
    num_running: int
    num_waiting: int
    num_inflight: int            # requests this router has sent and not seen finish
    free_kv_tokens: int
    compat_key: CompatKey
    healthy: bool = True
    total_kv_tokens: int = 0     # the worker's KV extent (0 = not reported)
    num_preemptions: int = 0     # sequences its engine preempted so far
    block_size: int = 0          # its KV block size and dtype (vllm:cache_config_info)
    dtype: str = ""
    # its speculative decoding counters (vllm:spec_decode_*), from its last GetInfo
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()

    @property
    def is_queue_full(self) -> bool:
        return self.max_queue > 0 and self.num_waiting >= self.max_queue

    @property
    def load(self) -> float:
        # The router's own in-flight count covers the requests sent since the last poll, so a
        # burst does not all land on the worker that looked idle a second ago.
        busy = max(self.num_running + self.num_waiting, self.num_inflight)
        return busy / max(self.max_batch, 1)


@dataclass(frozen=True)
class RoutePolicy:
    split_threshold_tokens: int = 256   # uncached prompt tokens from which a request is split


@dataclass(frozen=True)
class RouteRequest:
    num_prompt_tokens: int
    max_tokens: int              # new tokens the request may generate
    num_cached_tokens: int = 0   # leading prompt tokens loadable instead of computed

    @property
    def num_context_tokens(self) -> int:
        return self.num_prompt_tokens + self.max_tokens

    @property
    def num_uncached_tokens(self) -> int:
        return max(self.num_prompt_tokens - self.num_cached_tokens, 0)


@dataclass(frozen=True)
class Route:
    kind: Literal["split", "decode"]
    decode_address: str
    prefill_address: str | None
    reason: str


RefusalReason = Literal["no_decode_worker", "context_length_exceeded", "queue_full"]


@dataclass(frozen=True)
class Refusal:
    reason: RefusalReason
    limit: int                   # for context_length_exceeded: the largest max_context offered
    detail: str


def needs_lookup(num_prompt_tokens: int, policy: RoutePolicy) -> bool:
    """A cache lookup can only change the decision when the whole prompt reaches the threshold."""
    return num_prompt_tokens >= policy.split_threshold_tokens


def _rank(w: WorkerLoad) -> tuple[float, int, str]:
    return (w.load, -w.free_kv_tokens, w.address)


def other_prefill(workers: Sequence[WorkerLoad], failed: str, compat: CompatKey,
                  num_prompt_tokens: int) -> str | None:
    """The least-loaded healthy prefill worker other than ``failed`` that can hold the prompt
    and is compatible with the chosen decode worker, or None."""
    fits = sorted((w for w in workers if w.role == "prefill" and w.healthy and w.address != failed
                   and not w.is_queue_full and w.compat_key == compat
                   and w.max_context >= num_prompt_tokens + 1), key=_rank)
    return fits[0].address if fits else None


def choose_route(req: RouteRequest, workers: Sequence[WorkerLoad],
                 policy: RoutePolicy) -> Route | Refusal:
    """Pick the route of one request; a `Refusal` says why none fits."""
    decode = [w for w in workers if w.role == "decode" and w.healthy]
    if not decode:
        return Refusal("no_decode_worker", 0, "no healthy decode worker")
    fitting = [w for w in decode if w.max_context >= req.num_context_tokens]
    if not fitting:
        limit = max(w.max_context for w in decode)
        return Refusal("context_length_exceeded", limit,
                       f"{req.num_context_tokens} context tokens > max_context {limit}")
    open_decode = sorted((w for w in fitting if not w.is_queue_full), key=_rank)
    if not open_decode:
        return Refusal("queue_full", 0, f"{len(fitting)} decode worker(s) at max_queue")

    if req.num_uncached_tokens >= policy.split_threshold_tokens:
        prefill = sorted(
            (w for w in workers if w.role == "prefill" and w.healthy and not w.is_queue_full
             # the prefill worker holds the prompt plus the one token it samples
             and w.max_context >= req.num_prompt_tokens + 1),
            key=_rank)
        for d in open_decode:
            match = next((p for p in prefill if p.compat_key == d.compat_key), None)
            if match is not None:
                return Route("split", d.address, match.address,
                             f"{req.num_uncached_tokens} uncached tokens >= "
                             f"{policy.split_threshold_tokens}")
        return Route("decode", open_decode[0].address, None,
                     "no compatible prefill worker free; the decode worker prefills")
    return Route("decode", open_decode[0].address, None,
                 f"{req.num_uncached_tokens} uncached tokens < {policy.split_threshold_tokens}")


def choice_share(loads: Sequence[WorkerLoad]) -> int:
    """Fair share: the most choices (``n``, and the prompts of a list) one request runs at once,
    half the decode slots of the smallest healthy decode worker (at least 1), so one request's
    ``n`` cannot take every slot while others wait; its other choices start as these end."""
    batches = [w.max_batch for w in loads if w.role == "decode" and w.healthy and w.max_batch]
    return max(1, min(batches) // 2) if batches else 0
