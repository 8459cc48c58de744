"""Test doubles for the router tests: a tiny byte-level BPE tokenizer and a fake Worker servicer.

The fake worker implements the proto (GetInfo, Lookup, Prefill, Generate, Abort) with a scripted
output: the token ids of `SCRIPT` then EOS, one token per chunk.  It records what it was asked so
tests can check routing, cancellation and Abort.  Real gRPC servers, real sockets.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import jinja2
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from proto import ACCEPTED
from proto import bulkhead_pb2 as pb
from proto import bulkhead_pb2_grpc as pb_grpc

CORPUS = [
    "The answer is 42. END of the story, and then some more text follows here.",
    "Hello world! The quick brown fox jumps over the lazy dog. Bonjour à tous, ça va?",
    "user assistant system: what is the capital of France? Paris is the capital.",
]
SPECIALS = ["<|im_start|>", "<|im_end|>", "<eos>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SCRIPT = " The answer is 42. END of the story, ça va?"
# what a worker whose engine loop died answers the calls it was running (worker/codec.py maps
# EngineLoopFailed to UNAVAILABLE with its message) before it exits: a crash under the call
CRASHED = "engine loop failed: RuntimeError: boom"
QUEUE_S, PREFILL_S = 0.25, 0.5   # the queue and prefill times the fakes report


class TinyTokenizer:
    """Byte-level BPE trained on a few sentences; the router's tokenizer interface."""

    def __init__(self) -> None:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(CORPUS, trainer)
        self._tok = tok
        self._template = jinja2.Environment().from_string(CHAT_TEMPLATE)
        self.eos_token_ids = [tok.token_to_id("<eos>"), tok.token_to_id("<|im_end|>")]
        self.vocab_size = tok.get_vocab_size()

    def save_hf_folder(self, folder: Path) -> None:
        """tokenizer.json + tokenizer_config.json (EOS, chat template), as a checkpoint has."""
        self._tok.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {"eos_token": "<eos>", "chat_template": CHAT_TEMPLATE}))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
        return self._template.render(messages=messages, tools=tools,
                                     add_generation_prompt=add_generation_prompt, **kwargs)


COMPAT = pb.Compatibility(model_fingerprint="m1", tokenizer_fingerprint="t1", dtype="float32",
                          block_size=16, lmcache_chunk_size=256, kv_layout_fingerprint="kv1")


@dataclass
class FakeWorker(pb_grpc.WorkerServicer):
    """A scripted Worker.  Flip the public flags at runtime to make it misbehave."""

    role: str
    script: list[int]
    eos_id: int
    max_context: int = 512
    max_queue: int = 8
    compat: pb.Compatibility = field(default_factory=lambda: pb.Compatibility(**{
        f.name: getattr(COMPAT, f.name) for f in COMPAT.DESCRIPTOR.fields}))
    num_cached: int = 0               # Lookup answer
    token_delay_s: float = 0.0
    info_delay_s: float = 0.0         # GetInfo answers this late (a busy worker)
    prefill_error: grpc.StatusCode | None = None  # Prefill fails with this status
    prefill_error_details: str = "the worker cannot take it now"  # ... and these details
    exhausted: bool = False           # answer RESOURCE_EXHAUSTED
    fail_after: int = -1              # Generate: fail UNAVAILABLE after this many tokens
    frozen: bool = False              # a stalled engine: no token, counters stop (GetInfo answers)
    steps_completed: int = 0          # progress counters GetInfo reports: one step per token
    num_running: int = 0
    address: str = ""
    prefills: list[pb.PrefillRequest] = field(default_factory=list)
    generates: list[pb.GenerateRequest] = field(default_factory=list)
    lookups: int = 0
    aborts: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)
    num_generating: int = 0           # Generate calls running now
    max_generating: int = 0           # the most at once since the last reset

    def _output(self, sampling: pb.SamplingParams) -> list[int]:
        seq = list(self.script) + [self.eos_id]
        out: list[int] = []
        for tid in seq:
            out.append(tid)
            if len(out) >= sampling.max_tokens:
                return out
            if tid in sampling.stop_token_ids and not sampling.ignore_eos:
                return out
        while len(out) < sampling.max_tokens:   # ignore_eos: keep going with the script
            out.append(self.script[len(out) % len(self.script)])
        return out

    @staticmethod
    def _reason(out: list[int], sampling: pb.SamplingParams) -> str:
        if out and out[-1] in sampling.stop_token_ids and not sampling.ignore_eos:
            return "stop"
        return "length"

    async def GetInfo(self, request: Any, context: Any) -> pb.WorkerInfo:
        if self.info_delay_s:
            await asyncio.sleep(self.info_delay_s)
        return pb.WorkerInfo(worker_id=self.address, role=self.role, model_name="tiny",
                             compat=self.compat, max_context=self.max_context, chunk_tokens=64,
                             max_batch=4, max_queue=self.max_queue, free_kv_tokens=4096,
                             address=self.address, steps_completed=self.steps_completed,
                             tokens_advanced=self.steps_completed,
                             num_running=self.num_running)

    async def Lookup(self, request: Any, context: Any) -> pb.LookupResponse:
        self.lookups += 1
        return pb.LookupResponse(num_cached_tokens=min(self.num_cached,
                                                       len(request.prompt_token_ids)))

    async def Prefill(self, request: pb.PrefillRequest, context: Any) -> pb.PrefillResponse:
        await context.send_initial_metadata((ACCEPTED,))  # as a worker does (proto/__init__.py)
        if self.exhausted:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full (8 waiting)")
        if self.prefill_error is not None:
            self.prefills.append(request)
            await context.abort(self.prefill_error, self.prefill_error_details)
        self.prefills.append(request)
        await asyncio.sleep(self.token_delay_s)
        out = self._output(request.sampling)
        n = len(request.prompt_token_ids)
        reason = self._reason(out, request.sampling) if len(out) == 1 else ""
        return pb.PrefillResponse(
            request_id=request.request_id, first_token_id=out[0],
            kv=pb.KVHandle(num_tokens_stored=n, kv_layout_fingerprint="kv1", store_url="fake://"),
            num_prompt_tokens=n, num_cached_tokens=0, num_computed_tokens=n,
            finish_reason=reason, queue_time_s=QUEUE_S, prefill_time_s=PREFILL_S)

    async def Generate(self, request: pb.GenerateRequest, context: Any) -> Any:
        await context.send_initial_metadata((ACCEPTED,))
        if self.exhausted:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full (8 waiting)")
        self.generates.append(request)
        self.num_generating += 1
        self.max_generating = max(self.max_generating, self.num_generating)
        try:
            async for chunk in self._generate(request, context):
                yield chunk
        finally:
            self.num_generating -= 1

    async def _generate(self, request: pb.GenerateRequest, context: Any) -> Any:
        out = self._output(request.sampling)
        reason = self._reason(out, request.sampling)
        n = len(request.prompt_token_ids)
        tokens = out[1:] if request.has_prefill else out   # the first token is not repeated
        self.num_running += 1
        try:
            for i, tid in enumerate(tokens):
                await asyncio.sleep(self.token_delay_s)
                while self.frozen:
                    await asyncio.sleep(0.01)
                self.steps_completed += 1
                if i == self.fail_after:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "worker lost its device")
                last = i == len(tokens) - 1
                chunk = pb.GenerateChunk(token_ids=[tid], finish_reason=reason if last else "")
                if last:
                    loaded = n if request.has_prefill else 0
                    chunk.usage.CopyFrom(pb.Usage(
                        prompt_tokens=n, completion_tokens=len(out), cached_tokens=loaded,
                        loaded_kv_tokens=loaded, recomputed_tokens=n - loaded,
                        queue_time_s=QUEUE_S, prefill_time_s=PREFILL_S))
                yield chunk
            self.completed.append(request.request_id)
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise
        finally:
            self.num_running -= 1

    async def Abort(self, request: pb.AbortRequest, context: Any) -> pb.AbortResponse:
        self.aborts.append(request.request_id)
        return pb.AbortResponse(found=True)


class LoopThread:
    """An asyncio event loop in a daemon thread, for servers the synchronous tests talk to."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


async def start_worker(worker: FakeWorker) -> grpc.aio.Server:
    server = grpc.aio.server()
    pb_grpc.add_WorkerServicer_to_server(worker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    worker.address = f"127.0.0.1:{port}"
    await server.start()
    return server
