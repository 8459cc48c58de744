"""The decode worker: streams tokens of many requests at once (continuous batching).

Generate RPC, two ways in:
- ``has_prefill``: a prefill worker already ran the prompt and sampled ``first_token_id``. The
  engine loads the prompt's KV from LMCache into its own blocks (``kv_importer``) and computes
  whatever the store did not hold (a partial or evicted chunk), so the output is right either way.
  The stream does NOT repeat ``first_token_id``: it carries the tokens after it. For a family
  with per-sequence state (DeepSeek-V4) the store holds per-token state rows and the hook
  rebuilds the sequence's cache slot from them instead (``prepare_import`` picks by family).
- otherwise: a short prompt; the engine prefills it here inside its own plan (still loading any
  prefix the store holds).
Every chunk carries the tokens of one engine step; the last one carries the finish reason and
``Usage`` (loaded vs recomputed prompt tokens). Cancelling the call aborts the request, which
frees its blocks.

It never runs a Prefill RPC and never waits on the store from the asyncio loop.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator, Sequence

import grpc

from common.settings import WorkerSettings
from engine.errors import EngineError, InvalidRequest
from proto import bulkhead_pb2 as pb
from worker.codec import sampling_from_proto, usage_to_proto
from worker.engine_loop import EngineLoopFailed
from worker.worker_base import WorkerServicerBase, remaining_s, run_worker, serve_worker

log = logging.getLogger(__name__)


class DecodeServicer(WorkerServicerBase):
    role = "decode"

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateChunk]:
        """Stream the tokens of one request; see the module docstring."""
        rid = self.request_id(request.request_id)
        prompt = [int(t) for t in request.prompt_token_ids]
        try:
            sampling = sampling_from_proto(request.sampling)
        except InvalidRequest as exc:
            await self.fail(context, exc)
        deadline = request.deadline_unix_s
        left = remaining_s(deadline)
        if left is not None and left <= 0:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                "the request's deadline passed before decoding started")
        kv_import = None
        if (request.has_prefill and request.kv.kv_layout_fingerprint
                and request.kv.kv_layout_fingerprint != self.rt.compat.kv_layout_fingerprint):
            log.warning("request %s: KV layout %s differs from ours (%s); recomputing the prompt",
                        rid, request.kv.kv_layout_fingerprint,
                        self.rt.compat.kv_layout_fingerprint)
        elif (prompt and len(prompt) + sampling.max_tokens <= self.rt.engine.config.max_context
              and not (request.has_prefill and request.kv.num_tokens_stored == 0)):
            # (a request the plan will refuse, or a handoff that stored nothing, fetches nothing)
            kv_import = await self.prepare_import(prompt)
        first_token = int(request.first_token_id) if request.has_prefill else None
        try:
            stream = await self.loop.submit(rid, prompt, sampling, kv_import=kv_import,
                                            first_token_id=first_token)
        except (EngineError, EngineLoopFailed) as exc:
            await self.fail(context, exc)
        except asyncio.CancelledError:  # the add may still land: take it back
            self.loop.post(lambda engine: engine.abort(rid))
            raise
        try:
            while True:
                try:
                    out = await stream.next(remaining_s(deadline))
                except TimeoutError:
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                        f"request {rid} passed its deadline while decoding")
                except EngineLoopFailed as exc:
                    await self.fail(context, exc)
                if not out.finished:
                    if out.new_token_ids:
                        yield pb.GenerateChunk(token_ids=out.new_token_ids)
                    continue
                usage = usage_to_proto(out.num_prompt_tokens, out.num_output_tokens,
                                       out.num_cached_tokens, out.num_imported_tokens)
                yield pb.GenerateChunk(token_ids=out.new_token_ids,
                                       finish_reason=out.finish_reason or "stop", usage=usage)
                return
        finally:
            if not stream.done:  # cancelled by the client, deadline, or a failed write
                self.loop.post(lambda engine: engine.abort(rid))

    async def Prefill(self, request: pb.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            "this is a decode worker: send Prefill to a prefill worker")
        raise AssertionError("unreachable")


async def serve(settings: WorkerSettings) -> int:
    """Serve a decode worker with ``settings`` until SIGINT/SIGTERM; returns the exit code."""
    return await serve_worker(settings, DecodeServicer)


def main(argv: Sequence[str] | None = None) -> int:
    """``bulkhead decode``: serve a decode worker until SIGINT/SIGTERM."""
    return run_worker("decode", argv, DecodeServicer)


if __name__ == "__main__":
    sys.exit(main())

