"""The prefill worker: runs long prompts (chunked) and hands their KV to decode workers.

Prefill RPC: admission against the fixed plan (refused before any compute: OUT_OF_RANGE when the
prompt cannot fit, RESOURCE_EXHAUSTED when the queue is full), chunked prefill in the engine
thread, first token sampled, KV copied out of the kept blocks into LMCache, blocks released, and
the reply sent only once the remote store shows the KV (or the visibility deadline passed: the
reply then says how much is there and the decode side recomputes the rest).

It never streams tokens (Generate is the decode worker's) and never holds blocks after a reply.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
import time
from collections.abc import Sequence

import grpc

from engine.llm_engine import RequestOutput
from prefill_worker.export_gate import ExportGate
from prefill_worker.kv_export import export_kept_kv, wait_visible
from proto import ACCEPTED
from proto import bulkhead_pb2 as pb
from worker.codec import (
    logprobs_to_proto,
    prompt_logprobs_to_proto,
    sampling_from_proto,
    unary_rpc,
)
from worker.engine_loop import RequestStream
from worker.errors import DeadlinePassed, NoTokenSampled, RequestAborted
from worker.worker_base import (
    WorkerRuntime,
    WorkerServicerBase,
    remaining_s,
    run_worker,
    time_left,
)

log = logging.getLogger(__name__)


class PrefillServicer(WorkerServicerBase):
    role = "prefill"

    def __init__(self, rt: WorkerRuntime) -> None:
        super().__init__(rt)
        assert rt.kv_store is not None, "a prefill worker needs a KV store"
        self.kv_store = rt.kv_store
        # what a prompt's put takes of LMCache's pool: its whole blocks, each padded to whole
        # token rows of LMCache's memory objects (KVStoreConfig.padded_block_bytes)
        self._block_size = rt.kv_store.layout.block_size
        self._stored_block_bytes = rt.kv_store.config.padded_block_bytes
        self._gate = ExportGate(int(rt.kv_store.config.staging_gb * 2**30))

    @unary_rpc
    async def Prefill(self, request: pb.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        """Compute the prompt, store its KV, return the first token once the KV is visible."""
        await context.send_initial_metadata((ACCEPTED,))  # taken: a cut from now on is a crash
        rid = self.request_id(request.request_id)
        prompt = [int(t) for t in request.prompt_token_ids]
        sampling = sampling_from_proto(request.sampling)
        grammar = await self.grammar(request.sampling)
        timeout = time_left(request.deadline_unix_s, "the prefill")
        # The engine samples one token and keeps the blocks; the decode worker does the rest.
        # max_tokens 0 (only scoring the prompt) stays 0: no token, nothing to hand over.
        # Drafts are the decode worker's business (it checks the request's number).
        engine_sampling = dataclasses.replace(sampling, max_tokens=min(sampling.max_tokens, 1),
                                              min_tokens=min(sampling.min_tokens, 1),
                                              num_speculative_tokens=None)
        started = time.monotonic()
        # A prompt seen before loads, not computes; one to score is computed (KV has no logits).
        kv_import = (await self.prepare_import(prompt) if sampling.prompt_logprobs is None
                     else None)
        stream = await self.submit(rid, prompt, engine_sampling, keep_kv=True,
                                   kv_import=kv_import, grammar=grammar)
        kept = True
        try:
            try:
                final = await self._final(stream, timeout)
            except TimeoutError:
                raise DeadlinePassed(f"prefill of {len(prompt)} tokens passed the request's "
                                     f"deadline") from None
            if final.error is not None:  # this sequence alone was ended; its blocks are free
                kept = False
                raise final.error
            if final.finish_reason == "abort":
                kept = False
                raise RequestAborted(f"request {rid} was aborted")
            if not final.new_token_ids and sampling.max_tokens > 0:
                raise NoTokenSampled(f"request {rid} finished without a sampled token")
            finish_reason = self._finish_reason(final, sampling.max_tokens)
            visible = 0
            if finish_reason:  # the first token ends the request: no decode, nothing to hand over
                kept = False
                await self.loop.call(lambda engine: engine.release(rid))
            else:
                computed_at = time.monotonic()
                try:
                    taken = await self._gate.acquire(self._put_bytes(len(prompt)),
                                                     remaining_s(request.deadline_unix_s))
                except TimeoutError:
                    raise DeadlinePassed(f"the KV of a {len(prompt)}-token prompt waited for "
                                         "room in the store's pool past the request's "
                                         "deadline") from None
                try:
                    gated_at = time.monotonic()
                    num_tokens = await self.loop.call(
                        lambda engine: export_kept_kv(engine, self.kv_store, rid, prompt))
                    kept = False
                    put_at = time.monotonic()
                    visible = await wait_visible(self.kv_store, prompt[:num_tokens],
                                                 self.rt.settings.kv_visible_timeout_s,
                                                 request.deadline_unix_s)
                finally:
                    self._gate.release(taken)
                log.info("prefill %s: %d prompt tokens (%d loaded), computed in %.3f s, waited "
                         "%.3f s for the store's pool, KV put %.3f s, %d tokens visible after "
                         "%.3f s", rid, final.num_prompt_tokens, final.num_cached_tokens,
                         computed_at - started, gated_at - computed_at, put_at - gated_at,
                         visible, time.monotonic() - put_at)
        finally:
            if kept:  # cancelled or failed before the export: give the blocks back
                self.loop.post(lambda engine: engine.abort(rid))
        first = final.new_token_ids[-1] if final.new_token_ids else None
        first_logprobs = (logprobs_to_proto(final.logprobs[-1]) if final.logprobs else None)
        return pb.PrefillResponse(
            first_token_logprobs=first_logprobs,
            prompt_logprobs=prompt_logprobs_to_proto(final.prompt_logprobs),
            request_id=rid, first_token_id=first,
            kv=pb.KVHandle(num_tokens_stored=visible,
                           kv_layout_fingerprint=self.rt.compat.kv_layout_fingerprint,
                           store_url=self.kv_store.public_url),
            num_prompt_tokens=final.num_prompt_tokens,
            num_cached_tokens=final.num_cached_tokens,
            num_computed_tokens=final.num_prompt_tokens - final.num_cached_tokens,
            finish_reason=finish_reason, queue_time_s=final.queue_time_s,
            prefill_time_s=final.prefill_time_s)

    def _put_bytes(self, num_tokens: int) -> int:
        """The bytes a prompt of ``num_tokens`` takes of LMCache's pool while it is put (only
        whole blocks are stored)."""
        return num_tokens // self._block_size * self._stored_block_bytes

    @staticmethod
    async def _final(stream: RequestStream, timeout: float | None) -> RequestOutput:
        async with asyncio.timeout(timeout):
            while True:
                out = await stream.next()
                if out.finished:
                    return out

    @staticmethod
    def _finish_reason(final: RequestOutput, max_tokens: int) -> str:
        # The engine ran with max_tokens=1, so its "length" says nothing about the request.
        if final.finish_reason == "stop":
            return "stop"
        return "length" if max_tokens <= 1 else ""


def main(argv: Sequence[str] | None = None) -> int:
    """``bulkhead prefill``: serve a prefill worker until SIGINT/SIGTERM."""
    return run_worker("prefill", argv, PrefillServicer)


if __name__ == "__main__":
    sys.exit(main())
