"""One choice of one request, from routing decision to its last token.

Split route: Prefill on the prefill worker, send its first token at once, then Generate on the
decode worker with has_prefill, first_token_id and the KV handle.  Decode route: Generate alone.
Tokens become text through `TextStream`; a stop string ends the choice early, which cancels the
Generate call and sends Abort.  A decode worker that cannot be reached before it sent anything is
replaced once by another (`reroute`); a prefill that could not be done (worker unreachable,
stalled, aborted) is retried once on another prefill worker (`reroute_prefill`), and if none is
left the decode worker prefills the prompt itself.  A worker that died while running the call
(router/crash_blame.py) is different: the request may be what killed it, so it is never tried on
another worker; it is answered WorkerCrashed, or QuarantinedRequest when it is to blame.  Any
way out other than a normal finish (error, stop string, client disconnect) cancels the RPC and
Aborts the request on the worker.

Convention with the decode worker: after a split, the Generate stream does NOT repeat
first_token_id; it carries the tokens after it.  This module never formats HTTP answers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import grpc

from router.background import BackgroundTasks
from router.crash_blame import CrashBlame, Ticket, WorkerCrashed, is_crash
from router.errors import WorkerCallError
from router.logprobs_format import LogprobEntry, entries, token_text
from router.metrics import RouterMetrics
from router.policy import Route
from router.quarantine import QuarantinedRequest
from router.shared_quarantine import SharedQuarantine
from router.stall_watch import StallWatch
from router.text_stream import Decoder, TextOptions, TextStream
from router.worker_client import GenerateStream, WorkerClient
from router.worker_codec import Prefilled, Sampling, TokenLogprobs, Usage, WorkItem

log = logging.getLogger("bulkhead.router.choice")


@dataclass
class ChoiceDelta:
    """New output of one choice; `finish_reason` is set on its last delta."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[LogprobEntry] = field(default_factory=list)  # one per token, when asked


@dataclass
class ChoiceStats:
    """What the usage block and the metrics need once a choice ends."""

    num_cached_tokens: int = 0       # prompt tokens loaded instead of computed (client's view)
    num_loaded_tokens: int = 0       # prompt KV tokens loaded from the external store
    num_recomputed_tokens: int = 0   # prompt tokens computed by a worker
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[LogprobEntry] = field(default_factory=list)
    echo_len: int = 0                # leading characters of `text` that echo the prompt
    prompt_logprobs: list[LogprobEntry] = field(default_factory=list)  # echo with logprobs
    # the worker's queue (arrival to admission) and prefill (admission to first token) times,
    # from the worker that computed the prompt; decode: first token to last, seen here
    queue_time_s: float = 0.0
    prefill_time_s: float = 0.0
    decode_time_s: float = 0.0


@dataclass(frozen=True)
class ChoiceSpec:
    index: int
    request_id: str
    prompt_token_ids: list[int]
    sampling: Sampling
    stop: tuple[str, ...]
    route: Route
    deadline_unix_s: float
    echo: bool = False               # completions: the prompt's text opens the choice
    text: TextOptions = TextOptions()  # skip_special_tokens and the other detokenizing fields
    fingerprint: str = ""            # the request's (router/quarantine.py request_fingerprint)

    @property
    def work(self) -> WorkItem:
        """What the workers are sent for this choice."""
        return WorkItem(self.request_id, tuple(self.prompt_token_ids), self.sampling,
                        self.deadline_unix_s)


# Prefill failures a retry elsewhere can fix: the worker could not be reached, hung, answered
# nothing readable or was aborted. Not INTERNAL: a worker that answers it is up and failed this
# request (its step raised, engine/step_isolation.py), which the next worker would too. Not a
# crash either (`is_crash`), which is judged before this is asked.
RETRYABLE_PREFILL = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.ABORTED,
})


class ChoiceRunner:
    """Runs one choice against the workers; iterate `deltas()` once."""

    def __init__(self, spec: ChoiceSpec, clients: Callable[[str], WorkerClient],
                 tokenizer: Decoder, metrics: RouterMetrics, background: BackgroundTasks,
                 on_unavailable: Callable[[str, str], None],
                 reroute: Callable[[str], str | None] = lambda failed: None,
                 reroute_prefill: Callable[[str], str | None] = lambda failed: None,
                 quarantine: SharedQuarantine | None = None,
                 stall_watch: StallWatch | None = None,
                 blame: CrashBlame | None = None) -> None:
        self.spec = spec
        self.stats = ChoiceStats()
        self._clients = clients
        self._metrics = metrics
        self._background = background
        self._on_unavailable = on_unavailable
        self._reroute = reroute
        self._reroute_prefill = reroute_prefill
        self._quarantine = quarantine
        self._stall_watch = stall_watch
        self._blame = blame if blame is not None else CrashBlame()
        self._num_generated_chunks = 0
        self._text = TextStream(tokenizer, spec.prompt_token_ids, spec.stop, spec.text,
                                getattr(tokenizer, "special_token_ids", ()))
        self._tokenizer = tokenizer
        self._last_token_at: float | None = None
        self._first_token_at: float | None = None
        # the worker scores the prompt (completions echo with logprobs)
        self._scored = spec.echo and spec.sampling.prompt_logprobs is not None
        self._echoed = False

    def _delta(self, token_ids: list[int], finish_reason: str | None = None,
               logprobs: Sequence[TokenLogprobs] = ()) -> ChoiceDelta:
        now = time.monotonic()
        shown = token_ids
        if (finish_reason == "stop" and token_ids and not self.spec.text.include_stop_str_in_output
                and token_ids[-1] in self.spec.sampling.stop_token_ids):
            shown = token_ids[:-1]  # as vLLM: the stop token's text is not output (EOS, ...)
        if len(shown) > 1 and self.spec.stop:
            # several tokens at once (a verify step's accepted drafts): fed one by one, so the
            # tokens after the one that completes a stop string are dropped with their
            # logprobs, as they would never have come one token a step
            text = ""
            for i, token in enumerate(shown):
                text += self._text.add([token])
                if self._text.stopped:
                    token_ids, logprobs = token_ids[: i + 1], logprobs[: i + 1]
                    break
        else:
            text = self._text.add(shown)
        if token_ids:
            if self._last_token_at is not None:
                self._metrics.itl.observe(now - self._last_token_at)
            self._last_token_at = now
            if self._first_token_at is None:
                self._first_token_at = now
            self._metrics.generated_tokens.inc(len(token_ids))
        if self._text.stopped:
            finish_reason = "stop"
        elif finish_reason is not None:
            text += self._text.finish()
        self.stats.token_ids.extend(token_ids)
        self.stats.text += text
        self.stats.finish_reason = finish_reason
        if finish_reason is not None and self._first_token_at is not None:
            self.stats.decode_time_s = now - self._first_token_at
        lps = entries(self._tokenizer, logprobs)
        self.stats.logprobs.extend(lps)
        return ChoiceDelta(self.spec.index, text, token_ids, finish_reason, lps)

    def _echo(self, prompt_logprobs: Sequence[TokenLogprobs] | None) -> ChoiceDelta:
        """The delta that opens an echoed choice: the prompt's text and, when the prompt was
        scored, one logprob entry per prompt token (the first has none, as in OpenAI/vLLM)."""
        s = self.spec
        text = self._tokenizer.decode(s.prompt_token_ids, s.text.skip_special_tokens)
        self.stats.text = text
        self.stats.echo_len = len(text)
        lps: list[LogprobEntry] = []
        if prompt_logprobs is not None:
            lps = [LogprobEntry(token_text(self._tokenizer, s.prompt_token_ids[0]), None, None),
                   *entries(self._tokenizer, prompt_logprobs)]
            self.stats.prompt_logprobs = lps
        self._echoed = True
        return ChoiceDelta(s.index, text, [], logprobs=lps)

    def _abort_later(self, address: str) -> None:
        client = self._clients(address)
        self._background.spawn(client.abort(self.spec.request_id),
                               f"Abort of {self.spec.request_id} on {address}")

    def _failed(self, err: WorkerCallError, ticket: Ticket) -> Exception:
        """What to raise for ``err``: itself, or when its worker died under the call, the
        verdict on this request (router/crash_blame.py) as WorkerCrashed or QuarantinedRequest
        (recorded in the quarantine)."""
        if err.code == grpc.StatusCode.UNAVAILABLE:
            self._on_unavailable(err.address, f"{err.phase}: {err.details}")
        if not is_crash(err):
            return err
        verdict = self._blame.crashed(ticket)
        self._metrics.worker_crashes.labels("blamed" if verdict.blamed else "bystander").inc()
        if not verdict.blamed:
            log.warning("%s on %s: the worker died under %s (one of %d requests there); not "
                        "retried elsewhere", err.phase, err.address, self.spec.request_id,
                        verdict.num_suspects)
            return WorkerCrashed(err, verdict.num_suspects)
        why = (f"the {err.phase} worker {err.address} died while running it, the only request "
               "running there" if verdict.num_suspects == 1 else
               f"workers died while running it {verdict.num_crashes} times")
        log.error("request %s quarantined: %s", self.spec.request_id, why)
        if self._quarantine is not None:
            self._quarantine.add(ticket.fingerprint)
            return QuarantinedRequest(ticket.fingerprint, why, self._quarantine.local.ttl_s)
        return QuarantinedRequest(ticket.fingerprint, why, self._blame.window_s)

    async def _prefill(self, address: str) -> Prefilled:
        started = time.monotonic()
        done = False
        ticket = self._blame.begin(address, self.spec.fingerprint)
        try:
            resp = await self._prefill_unless_stalled(address)
            done = True
        except WorkerCallError as err:
            done = err.code == grpc.StatusCode.UNAVAILABLE   # it never reached the worker
            raise self._failed(err, ticket) from None
        finally:
            self._blame.end(ticket)
            if not done:
                self._abort_later(address)
        self._metrics.phase.labels("prefill").observe(time.monotonic() - started)
        self.stats.num_cached_tokens = resp.num_cached_tokens
        self.stats.num_recomputed_tokens = resp.num_computed_tokens
        self.stats.queue_time_s, self.stats.prefill_time_s = (resp.queue_time_s,
                                                              resp.prefill_time_s)
        return resp

    async def _prefill_unless_stalled(self, address: str) -> Prefilled:
        """The Prefill RPC, given up (DEADLINE_EXCEEDED, which is retried elsewhere) as soon as
        the worker stops advancing, instead of at the end of `prefill_timeout_s`."""
        call = asyncio.ensure_future(self._clients(address).prefill(self.spec.work))
        if self._stall_watch is None:
            return await call
        watch = asyncio.ensure_future(self._stall_watch.wait(address))
        try:
            await asyncio.wait({call, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (call, watch):
                if not task.done():
                    task.cancel()
            await asyncio.gather(call, watch, return_exceptions=True)
        if call.cancelled():
            problem = watch.result()
            self._on_unavailable(address, f"prefill: {problem}")
            raise WorkerCallError(address, "prefill", grpc.StatusCode.DEADLINE_EXCEEDED,
                                  f"the worker stopped advancing: {problem}")
        return call.result()

    async def _prefill_with_retry(self, address: str) -> Prefilled | None:
        """Prefill on ``address``; if that worker could not be reached, stalled or aborted it,
        once more on another prefill worker; if none is left (or it fails too), None: the
        decode worker, whose plan the policy checked holds this context, prefills the prompt
        itself. Errors the request itself causes (bad input, over the plan, a step that raised)
        are raised as they are, and a worker that died under it raises the verdict on it."""
        tried = address
        for attempt in (1, 2):
            try:
                return await self._prefill(tried)
            except WorkerCallError as err:  # a crash is not one: WorkerCrashed / Quarantined
                if err.code not in RETRYABLE_PREFILL:
                    raise
                other = self._reroute_prefill(tried) if attempt == 1 else None
                log.warning("prefill of %s on %s failed (%s: %s); %s", self.spec.request_id,
                            tried, err.code.name, err.details,
                            f"retrying on {other}" if other else
                            f"{self.spec.route.decode_address} prefills it itself")
                if other is None:
                    return None
                self._metrics.prefill_retries.inc()
                tried = other
        return None

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        s = self.spec
        if s.echo and not self._scored:  # scored: the echo waits for the prompt's logprobs
            yield self._echo(None)
        prefilled = None
        if s.route.kind == "split":
            assert s.route.prefill_address is not None
            prefilled = await self._prefill_with_retry(s.route.prefill_address)
        if prefilled is not None:
            if self._scored and not self._echoed:
                yield self._echo(prefilled.prompt_logprobs)
            if prefilled.first_token_id is None:  # max_tokens 0: the prompt was only scored
                yield self._delta([], prefilled.finish_reason or "length")
                return
            first_lp = ([prefilled.first_token_logprobs]
                        if prefilled.first_token_logprobs is not None else [])
            delta = self._delta([prefilled.first_token_id], prefilled.finish_reason, first_lp)
            yield delta
            if delta.finish_reason is not None:
                return
        address = s.route.decode_address
        try:
            async for delta in self._generate(address, prefilled):
                yield delta
        except WorkerCallError as err:
            # Nothing ran on a worker we could not reach: try one other decode worker (the KV of
            # a split is in the store, so any compatible decode worker can load it).
            if err.code != grpc.StatusCode.UNAVAILABLE or self._num_generated_chunks:
                raise
            other = self._reroute(address)
            if other is None:
                raise
            async for delta in self._generate(other, prefilled):
                yield delta

    async def _generate(self, address: str,
                        after: Prefilled | None) -> AsyncIterator[ChoiceDelta]:
        stream = self._clients(address).generate(self.spec.work, after)
        watch = self._watch(address, stream)
        ticket = self._blame.begin(address, self.spec.fingerprint)
        started = time.monotonic()
        first = True
        finished = unreachable = False
        try:
            async for chunk in stream:
                self._num_generated_chunks += 1
                if first:
                    self._metrics.phase.labels("first_token").observe(time.monotonic() - started)
                    first = False
                reason = chunk.finish_reason
                if reason == "abort":
                    finished = True
                    raise WorkerCallError(address, "decode", grpc.StatusCode.ABORTED,
                                          "the worker aborted the request")
                if chunk.usage is not None:
                    self._take_usage(chunk.usage, after is not None)
                if self._scored and not self._echoed and after is None:
                    yield self._echo(chunk.prompt_logprobs)
                delta = self._delta(list(chunk.token_ids), reason, chunk.logprobs)
                if delta.finish_reason is not None:
                    # a stop string ends the choice while the worker still runs: abort it below
                    finished = reason is not None
                    yield delta
                    return
                if delta.text or delta.token_ids:
                    yield delta
            raise WorkerCallError(address, "decode", grpc.StatusCode.INTERNAL,
                                  "the Generate stream ended without a finish reason")
        except WorkerCallError as err:
            unreachable = err.code == grpc.StatusCode.UNAVAILABLE   # an Abort would not arrive
            raise self._failed(err, ticket) from None
        finally:
            self._blame.end(ticket)
            if watch is not None:
                watch.cancel()
            self._metrics.phase.labels("decode").observe(time.monotonic() - started)
            if not finished:
                stream.cancel()
                if not unreachable:
                    self._abort_later(address)

    def _watch(self, address: str, stream: GenerateStream) -> asyncio.Future[None] | None:
        """Give up on ``stream`` once its worker stops advancing (router/stall_watch.py), after
        ``stall_timeout_s`` rather than a first-token or stream-idle deadline per chunk: before
        any chunk as UNAVAILABLE (another decode worker takes the choice, `deltas`), after
        some as DEADLINE_EXCEEDED (a 504 or an error event, at once)."""
        if self._stall_watch is None:
            return None

        async def watch() -> None:
            problem = await self._stall_watch.wait(address)  # type: ignore[union-attr]
            code = (grpc.StatusCode.UNAVAILABLE if self._num_generated_chunks == 0
                    else grpc.StatusCode.DEADLINE_EXCEEDED)
            log.warning("decode of %s on %s given up: %s", self.spec.request_id, address,
                        problem)
            self._on_unavailable(address, f"decode: {problem}")  # the worker's state, not ours
            stream.give_up(code, f"the worker stopped advancing: {problem}")

        return asyncio.ensure_future(watch())

    def _take_usage(self, usage: Usage, has_prefill: bool) -> None:
        self.stats.num_loaded_tokens = usage.loaded_kv_tokens
        if has_prefill:
            # the prefill worker computed the prompt; the decode side only loaded/recomputed a tail
            self.stats.num_recomputed_tokens += usage.recomputed_tokens
        else:
            self.stats.num_cached_tokens = usage.cached_tokens
            self.stats.num_recomputed_tokens = usage.recomputed_tokens
            self.stats.queue_time_s = usage.queue_time_s
            self.stats.prefill_time_s = usage.prefill_time_s
