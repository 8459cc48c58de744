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

from common.settings import WorkerSettings
from engine.errors import EngineError, InvalidRequest
from engine.llm_engine import LLMEngine, RequestOutput
from proto import bulkhead_pb2 as pb
from worker.codec import sampling_from_proto
from worker.engine_loop import EngineLoopFailed, RequestStream
from worker.worker_base import (
    WorkerRuntime,
    WorkerServicerBase,
    remaining_s,
    run_worker,
    serve_worker,
)

log = logging.getLogger(__name__)


class PrefillServicer(WorkerServicerBase):
    role = "prefill"

    def __init__(self, rt: WorkerRuntime) -> None:
        super().__init__(rt)
        assert rt.kv_store is not None, "a prefill worker needs a KV store"
        self.kv_store = rt.kv_store

    async def Prefill(self, request: pb.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        """Compute the prompt, store its KV, return the first token once the KV is visible."""
        rid = self.request_id(request.request_id)
        prompt = [int(t) for t in request.prompt_token_ids]
        try:
            sampling = sampling_from_proto(request.sampling)
        except InvalidRequest as exc:
            await self.fail(context, exc)
        timeout = remaining_s(request.deadline_unix_s)
        if timeout is not None and timeout <= 0:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                "the request's deadline passed before the prefill started")
        # The engine samples one token and keeps the blocks; the decode worker does the rest.
        engine_sampling = dataclasses.replace(sampling, max_tokens=1)
        started = time.monotonic()
        kv_import = await self.prepare_import(prompt)  # a prompt seen before loads, not computes
        try:
            stream = await self.loop.submit(rid, prompt, engine_sampling, keep_kv=True,
                                            kv_import=kv_import)
        except (EngineError, EngineLoopFailed) as exc:
            await self.fail(context, exc)
        except asyncio.CancelledError:  # the add may still land: take it back
            self.loop.post(lambda engine: engine.abort(rid))
            raise
        kept = True
        try:
            try:
                final = await self._final(stream, timeout)
            except EngineLoopFailed as exc:
                await self.fail(context, exc)
            except TimeoutError:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"prefill of {len(prompt)} tokens passed the request's "
                                    f"deadline")
            if final.finish_reason == "abort":
                kept = False
                await context.abort(grpc.StatusCode.ABORTED, f"request {rid} was aborted")
            if not final.new_token_ids:
                await context.abort(grpc.StatusCode.INTERNAL,
                                    f"request {rid} finished without a sampled token")
            finish_reason = self._finish_reason(final, sampling.max_tokens)
            visible = 0
            if finish_reason:  # the first token ends the request: no decode, nothing to hand over
                kept = False
                await self.loop.call(lambda engine: engine.release(rid))
            else:
                computed_at = time.monotonic()
                num_tokens = await self.loop.call(
                    lambda engine: self._export(engine, rid, prompt))
                kept = False
                put_at = time.monotonic()
                visible_timeout = self.rt.settings.kv_visible_timeout_s
                left = remaining_s(request.deadline_unix_s)
                if left is not None:
                    visible_timeout = max(min(visible_timeout, left), 0.0)
                visible = await asyncio.to_thread(self.kv_store.wait_visible,
                                                  prompt[:num_tokens], visible_timeout)
                log.info("prefill %s: %d prompt tokens (%d loaded), computed in %.3f s, KV put "
                         "%.3f s, %d tokens visible after %.3f s", rid, final.num_prompt_tokens,
                         final.num_cached_tokens, computed_at - started, put_at - computed_at,
                         visible, time.monotonic() - put_at)
        finally:
            if kept:  # cancelled or failed before the export: give the blocks back
                self.loop.post(lambda engine: engine.abort(rid))
        first = final.new_token_ids[-1]
        return pb.PrefillResponse(
            request_id=rid, first_token_id=first,
            kv=pb.KVHandle(num_tokens_stored=visible,
                           kv_layout_fingerprint=self.rt.compat.kv_layout_fingerprint,
                           store_url=self.kv_store.public_url),
            num_prompt_tokens=final.num_prompt_tokens,
            num_cached_tokens=final.num_cached_tokens,
            num_computed_tokens=final.num_prompt_tokens - final.num_cached_tokens,
            finish_reason=finish_reason)

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> pb.GenerateChunk:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            "this is a prefill worker: send Generate to a decode worker")
        raise AssertionError("unreachable")

    @staticmethod
    async def _final(stream: RequestStream, timeout: float | None) -> RequestOutput:
        async with asyncio.timeout(timeout):
            while True:
                out = await stream.next()
                if out.finished:
                    return out

    def _export(self, engine: LLMEngine, rid: str, prompt: Sequence[int]) -> int:
        """On the engine thread: copy the kept KV (or, for a per-slot family, the slot's state
        rows) into LMCache, then free the blocks and the slot."""
        try:
            block_ids, num_tokens = engine.kept_kv(rid)
            if engine.slot_state is not None:  # per-sequence state: its per-token rows
                rows = engine.slot_state.export_rows(engine.kept_slot(rid), num_tokens)
                self.kv_store.put(prompt[:num_tokens], rows, [])
            else:
                self.kv_store.put(prompt[:num_tokens], engine.kv_cache.data, block_ids)
            return num_tokens
        except Exception as exc:  # the decode side then recomputes: slower, still right
            log.warning("prefill %s: KV export failed: %s", rid, exc)
            return 0
        finally:
            engine.release(rid)

    @staticmethod
    def _finish_reason(final: RequestOutput, max_tokens: int) -> str:
        # The engine ran with max_tokens=1, so its "length" says nothing about the request.
        if final.finish_reason == "stop":
            return "stop"
        return "length" if max_tokens == 1 else ""


async def serve(settings: WorkerSettings) -> int:
    """Serve a prefill worker with ``settings`` until SIGINT/SIGTERM; returns the exit code."""
    return await serve_worker(settings, PrefillServicer)


def main(argv: Sequence[str] | None = None) -> int:
    """``bulkhead prefill``: serve a prefill worker until SIGINT/SIGTERM."""
    return run_worker("prefill", argv, PrefillServicer)


if __name__ == "__main__":
    sys.exit(main())
