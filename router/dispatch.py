"""Turns a `GenerationJob` into running choices: cache lookup, routing, fan-out.

`Dispatcher.start(job)` asks the policy for a route per choice (counting each choice as in flight
on its workers at once, so the n choices of a burst spread out) and returns a `Dispatch` whose
`deltas()` merges the choices' outputs as they come.  Refusals become `ApiError`s here, before
anything is sent to a worker.  This module must never format HTTP answers or import torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from router.background import BackgroundTasks
from router.choice_runner import ChoiceDelta, ChoiceRunner, ChoiceSpec
from router.crash_blame import CrashBlame
from router.errors import (
    ApiError,
    WorkerCallError,
    context_length_exceeded,
    no_worker,
    queue_full,
)
from router.job import GenerationJob
from router.metrics import RouterMetrics
from router.policy import (
    Refusal,
    Route,
    RoutePolicy,
    RouteRequest,
    choice_share,
    choose_route,
    needs_lookup,
    other_prefill,
)
from router.quarantine import Quarantine, QuarantinedRequest, request_fingerprint
from router.registry import WorkerRegistry
from router.settings import RouterSettings
from router.shared_quarantine import SharedQuarantine
from router.stall_watch import StallWatch
from router.tokenizer_port import RouterTokenizer
from router.worker_codec import Sampling

log = logging.getLogger("bulkhead.router.dispatch")


@dataclass
class Dispatch:
    """The running choices of one request."""

    request_id: str
    runners: list[ChoiceRunner]
    leases: contextlib.ExitStack
    # most choices of this request running at once (fair share, `choice_share`); 0 = all
    max_running: int = 0

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """All choices' deltas as they arrive; the first failure cancels the other choices.
        At most ``max_running`` choices run at once: the next starts as one ends."""
        queue: asyncio.Queue[ChoiceDelta | BaseException | None] = asyncio.Queue()
        share = asyncio.Semaphore(self.max_running or len(self.runners) or 1)

        async def pump(runner: ChoiceRunner) -> None:
            try:
                async with share:
                    async for d in runner.deltas():
                        queue.put_nowait(d)
                queue.put_nowait(None)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                queue.put_nowait(exc)

        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(pump(r)) for r in self.runners]
        remaining = len(tasks)
        try:
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.close()

    def close(self) -> None:
        """Stop counting the choices as in flight on their workers (idempotent)."""
        self.leases.close()


class Dispatcher:
    def __init__(self, settings: RouterSettings, tokenizer: RouterTokenizer,
                 registry: WorkerRegistry, metrics: RouterMetrics,
                 background: BackgroundTasks) -> None:
        self._settings = settings
        self._tokenizer = tokenizer
        self._registry = registry
        self._metrics = metrics
        self._background = background
        self._policy = RoutePolicy(split_threshold_tokens=settings.split_threshold_tokens)
        # shared with the other routers on the worker registry's Redis, when there is one
        self.quarantine = SharedQuarantine(Quarantine(ttl_s=settings.quarantine_ttl_s),
                                           settings.registry_url)
        # which request a worker crash is blamed on (and so quarantined), within the same TTL
        self.blame = CrashBlame(window_s=settings.quarantine_ttl_s)
        # a prefill on a worker that stops advancing is given up after stall_timeout_s
        self._stall_watch = StallWatch(self._worker_problem, registry.info,
                                       settings.stall_timeout_s,
                                       min(settings.poll_interval_s, 1.0))

    def _worker_problem(self, address: str) -> str:
        """'' while the registry routes to `address`, else why not."""
        for w in self._registry.loads():
            if w.address == address:
                return "" if w.healthy else self._registry.problems().get(address, "unhealthy")
        return "no longer in the worker registry"

    async def aclose(self) -> None:
        """Finish pending quarantine writes and close the quarantine's Redis connection."""
        await self.quarantine.aclose()

    def _sampling(self, job: GenerationJob, max_tokens: int, choice: int) -> Sampling:
        stop_ids = list(job.stop_token_ids)
        if not job.ignore_eos:
            stop_ids += [t for t in self._tokenizer.eos_token_ids if t not in stop_ids]
        # n independent decodes: choice i draws from seed + i, so choices differ but the
        # request as a whole is reproducible
        seed = (job.seed + choice) % 2**64 if job.seed is not None else None
        return Sampling(max_tokens=max_tokens, temperature=job.temperature, top_p=job.top_p,
                        top_k=job.top_k, stop_token_ids=tuple(stop_ids),
                        ignore_eos=job.ignore_eos, seed=seed,
                        shaping=replace(job.shaping,
                                        min_tokens=min(job.shaping.min_tokens, max_tokens)),
                        logprobs=job.logprobs,
                        grammar_kind=job.grammar_kind, grammar_spec=job.grammar_spec,
                        prompt_logprobs=job.prompt_logprobs,
                        num_speculative_tokens=job.num_speculative_tokens)

    def context_limit(self) -> int:
        """The largest context a healthy decode worker plans for; 503 when there is none."""
        decode = [w for w in self._registry.loads() if w.role == "decode" and w.healthy]
        if not decode:
            raise no_worker("decode", self._settings.retry_after_s,
                            "; ".join(f"{a}: {p}" for a, p in self._registry.problems().items()))
        return max(w.max_context for w in decode)

    async def _num_cached(self, prompt: tuple[int, ...]) -> int:
        loads = self._registry.loads()
        if not needs_lookup(len(prompt), self._policy) or not any(
                w.role == "prefill" and w.healthy for w in loads):
            return 0
        decode = sorted((w for w in loads if w.role == "decode" and w.healthy),
                        key=lambda w: w.load)
        if not decode:
            return 0
        started = time.monotonic()
        try:
            return await self._registry.client(decode[0].address).lookup(prompt)
        except WorkerCallError as err:
            log.warning("Lookup failed, treating the prompt as uncached: %s", err)
            return 0
        finally:
            self._metrics.phase.labels("lookup").observe(time.monotonic() - started)

    def _reroute(self, req: RouteRequest, route: Route, leases: contextlib.ExitStack,
                 failed: str) -> str | None:
        """Another decode worker for a choice whose worker was unreachable, or None."""
        loads = self._registry.loads()
        keys = {w.address: w.compat_key for w in loads}
        want = keys.get(route.prefill_address) if route.prefill_address else None
        others = [w for w in loads if w.address != failed and w.role == "decode" and w.healthy
                  and (want is None or w.compat_key == want)]
        retry = choose_route(RouteRequest(req.num_prompt_tokens, req.max_tokens,
                                          req.num_prompt_tokens), others, self._policy)
        if isinstance(retry, Refusal):
            return None
        log.info("decode worker %s unreachable; %s takes the request", failed,
                 retry.decode_address)
        leases.enter_context(self._registry.track(retry.decode_address))
        return retry.decode_address

    def _reroute_prefill(self, req: RouteRequest, route: Route, leases: contextlib.ExitStack,
                         failed: str) -> str | None:
        """Another prefill worker for a choice whose prefill failed, or None."""
        loads = self._registry.loads()
        keys = {w.address: w.compat_key for w in loads}
        other = other_prefill(loads, failed, keys.get(route.decode_address),
                              req.num_prompt_tokens)
        if other is not None:
            leases.enter_context(self._registry.track(other))
        return other

    def _refused(self, refusal: Refusal, req: RouteRequest, param: str) -> ApiError:
        retry = self._settings.retry_after_s
        if refusal.reason == "context_length_exceeded":
            return context_length_exceeded(req.num_prompt_tokens, req.max_tokens, refusal.limit,
                                           param)
        if refusal.reason == "queue_full":
            return queue_full(retry, refusal.detail)
        return no_worker("decode", retry, refusal.detail)

    async def start(self, job: GenerationJob) -> Dispatch:
        """Route every choice; raise ApiError if any cannot run."""
        limit = self.context_limit()
        request_id = f"{'chatcmpl' if job.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        deadline = (time.time() + self._settings.request_timeout_s
                    if self._settings.request_timeout_s > 0 else 0.0)
        param = "messages" if job.kind == "chat" else "prompt"
        plans = []
        for prompt in job.prompts:
            # Without max_tokens a choice may fill what the largest plan leaves (at least one
            # token); whether it fits a worker is checked once, by the policy (choose_route).
            max_tokens = (job.max_tokens if job.max_tokens is not None
                          else max(limit - len(prompt), 1))
            fp = request_fingerprint(self._settings.model_name, prompt,
                                     self._sampling(job, max_tokens, 0))
            if await self.quarantine.contains(fp):
                raise QuarantinedRequest(fp, "a worker died while running an identical "
                                         "request, which was blamed for it",
                                         self._settings.quarantine_ttl_s)
            # a prompt to score is computed in full wherever it runs: nothing of it is cached
            cached = 0 if job.prompt_logprobs is not None else await self._num_cached(prompt)
            plans.append((prompt, max_tokens, cached, fp))

        leases = contextlib.ExitStack()
        runners = []
        try:
            for p_index, (prompt, max_tokens, num_cached, fp) in enumerate(plans):
                req = RouteRequest(len(prompt), max_tokens, num_cached)
                for i in range(job.n):
                    index = p_index * job.n + i
                    route = choose_route(req, self._registry.loads(), self._policy)
                    if isinstance(route, Refusal):
                        raise self._refused(route, req, param)
                    leases.enter_context(self._registry.track(route.decode_address))
                    if route.prefill_address is not None:
                        leases.enter_context(self._registry.track(route.prefill_address))
                    self._metrics.routes.labels(route.kind).inc()
                    spec = ChoiceSpec(index=index, request_id=f"{request_id}-{index}",
                                      prompt_token_ids=list(prompt),
                                      sampling=self._sampling(job, max_tokens, i),
                                      stop=job.stop, route=route, deadline_unix_s=deadline,
                                      echo=job.echo, text=job.text, fingerprint=fp)
                    runners.append(ChoiceRunner(
                        spec, self._registry.client, self._tokenizer, self._metrics,
                        self._background, self._registry.mark_unavailable,
                        functools.partial(self._reroute, req, route, leases),
                        functools.partial(self._reroute_prefill, req, route, leases),
                        self.quarantine, self._stall_watch, self.blame))
        except BaseException:
            leases.close()
            raise
        return Dispatch(request_id, runners, leases, choice_share(self._registry.loads()))
