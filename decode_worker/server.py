"""The decode worker: streams tokens of many requests at once (continuous batching).

Generate RPC, two ways in:
- ``has_prefill``: a prefill worker already ran the prompt and sampled ``first_token_id``. The
  engine loads the prompt's KV from LMCache into its own blocks (``kv_importer``) and computes
  whatever the store did not hold (a partial or evicted chunk), so the output is right either way.
  The stream does NOT repeat ``first_token_id``: it carries the tokens after it. The store
  holds whole blocks of the engine's KV layout, whatever the family.
- otherwise: a short prompt; the engine prefills it here inside its own plan (still loading any
  prefix the store holds).
Every chunk carries the tokens of one engine step; the last one carries the finish reason and
``Usage`` (loaded vs recomputed prompt tokens). Cancelling the call aborts the request, which
frees its blocks.

It never runs a Prefill RPC and never waits on the store from the asyncio loop.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import AsyncIterator, Sequence

import grpc

from decode_worker.import_decision import decide_import
from proto import ACCEPTED
from proto import bulkhead_pb2 as pb
from worker.codec import (
    logprobs_to_proto,
    prompt_logprobs_to_proto,
    sampling_from_proto,
    stream_rpc,
    usage_to_proto,
)
from worker.errors import DeadlinePassed
from worker.worker_base import (
    WorkerServicerBase,
    remaining_s,
    run_worker,
    time_left,
)

log = logging.getLogger(__name__)


class DecodeServicer(WorkerServicerBase):
    role = "decode"

    @stream_rpc
    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateChunk]:
        """Stream the tokens of one request; see the module docstring."""
        await context.send_initial_metadata((ACCEPTED,))  # taken: a cut from now on is a crash
        rid = self.request_id(request.request_id)
        prompt = [int(t) for t in request.prompt_token_ids]
        sampling = sampling_from_proto(request.sampling)
        grammar = await self.grammar(request.sampling)
        deadline = request.deadline_unix_s
        time_left(deadline, "decoding")
        decision = decide_import(len(prompt), request.has_prefill,
                                 request.kv.kv_layout_fingerprint, request.kv.num_tokens_stored,
                                 self.rt.compat.kv_layout_fingerprint)
        if decision.fetch and sampling.prompt_logprobs is None:  # scoring computes the prompt
            kv_import = await self.prepare_import(prompt)
        else:
            kv_import = None
            if request.has_prefill:
                log.warning("request %s: %s", rid, decision.reason)
        first_token = int(request.first_token_id) if request.has_prefill else None
        stream = await self.submit(rid, prompt, sampling, kv_import=kv_import,
                                   first_token_id=first_token, grammar=grammar)
        try:
            while True:
                try:
                    out = await stream.next(remaining_s(deadline))
                except TimeoutError:
                    raise DeadlinePassed(f"request {rid} passed its deadline while "
                                         f"decoding") from None
                if out.error is not None:  # this sequence alone was ended (engine.errors)
                    raise out.error
                logprobs = [logprobs_to_proto(lp) for lp in out.logprobs or ()]
                prompt_lps = prompt_logprobs_to_proto(out.prompt_logprobs)
                if not out.finished:
                    if out.new_token_ids:
                        yield pb.GenerateChunk(token_ids=out.new_token_ids, logprobs=logprobs,
                                               prompt_logprobs=prompt_lps)
                    continue
                usage = usage_to_proto(out.num_prompt_tokens, out.num_output_tokens,
                                       out.num_cached_tokens, out.num_imported_tokens,
                                       out.queue_time_s, out.prefill_time_s)
                yield pb.GenerateChunk(token_ids=out.new_token_ids, logprobs=logprobs,
                                       prompt_logprobs=prompt_lps,
                                       finish_reason=out.finish_reason or "stop", usage=usage)
                return
        finally:
            if not stream.done:  # cancelled by the client, deadline, or a failed write
                self.loop.post(lambda engine: engine.abort(rid))


def main(argv: Sequence[str] | None = None) -> int:
    """``bulkhead decode``: serve a decode worker until SIGINT/SIGTERM."""
    return run_worker("decode", argv, DecodeServicer)


if __name__ == "__main__":
    sys.exit(main())

