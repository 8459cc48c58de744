"""gRPC client of one worker: every call has a deadline and every failure is a `WorkerCallError`.

A `Generate` stream is read through `GenerateStream`, which applies the first-token and
stream-idle deadlines and cancels the call (the worker then aborts the request) when they pass
or when the caller stops early.  `WorkerAccess` is what the router presents to workers: the
shared internal token (sent as `authorization: Bearer <token>` metadata on every call; checked
by worker/auth.py) and, when set, the CA that makes the channel TLS.  This module must never
block forever, never log the token and never import torch. Proto messages stop here: callers
hand in and get back router/worker_codec.py's dataclasses (router/worker_status.py for GetInfo).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from proto import ACCEPTED
from proto import bulkhead_pb2 as pb
from proto import bulkhead_pb2_grpc as pb_grpc
from router.errors import WorkerCallError
from router.worker_codec import (
    Chunk,
    Prefilled,
    WorkItem,
    chunk_from_proto,
    generate_request,
    prefill_request,
    prefilled_from_proto,
)
from router.worker_status import WorkerStatus, status_from_proto


@dataclass(frozen=True)
class CallDeadlines:
    """Seconds each phase may take; see RouterSettings for their meaning."""

    info_s: float = 2.0
    prefill_s: float = 300.0
    first_token_s: float = 120.0
    stream_idle_s: float = 60.0


@dataclass(frozen=True)
class WorkerAccess:
    """The shared internal token and, for TLS, the PEM CA bundle the workers' certificates chain
    to; the defaults are a plaintext channel without a token."""

    token: str = field(default="", repr=False)
    tls_ca_pem: bytes = field(default=b"", repr=False)

    @classmethod
    def load(cls, token: str, tls_ca_file: str = "") -> WorkerAccess:
        """Read the CA bundle once (``''`` = plaintext); a missing file is an error naming it."""
        if not tls_ca_file:
            return cls(token)
        try:
            pem = Path(tls_ca_file).read_bytes()
        except OSError as exc:
            raise ValueError(f"worker_tls_ca_file: cannot read {tls_ca_file}: {exc}") from exc
        return cls(token, pem)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def channel(self, address: str, options: Sequence[tuple[str, Any]]) -> grpc.aio.Channel:
        if self.tls_ca_pem:
            creds = grpc.ssl_channel_credentials(root_certificates=self.tls_ca_pem)
            return grpc.aio.secure_channel(address, creds, options=list(options))
        return grpc.aio.insecure_channel(address, options=list(options))


EMPTY_ANSWER = "the answer held no readable message"
# How soon a channel whose worker went away tries to connect again. gRPC's own back-off grows
# to 120 s; after a decode worker was down 16 s it had reached ~10 s, so the router's polls
# kept failing on the channel's remembered error for 12 s after the restarted worker served
# (lab/bench/restart.py). At most 1 s: the router's poll (poll_interval_s, 2 s) sees it next time.
RECONNECT_BACKOFF = (("grpc.initial_reconnect_backoff_ms", 250),
                     ("grpc.max_reconnect_backoff_ms", 1000))


async def _reached(call: Any) -> bool:
    """Whether the worker's handler took ``call`` (it sent ACCEPTED); asked of a call that has
    ended, so it does not wait."""
    try:
        metadata = await call.initial_metadata()
    except (grpc.RpcError, asyncio.CancelledError, AttributeError):
        return False
    return ACCEPTED in tuple(metadata or ())


class GenerateStream:
    """One server-streaming Generate call, read chunk by chunk under deadlines."""

    def __init__(self, call: Any, address: str, deadlines: CallDeadlines) -> None:
        self._call = call
        self._address = address
        self._deadlines = deadlines
        self._num_chunks = 0
        self._done = False
        self._given_up: WorkerCallError | None = None

    def __aiter__(self) -> GenerateStream:
        return self

    async def __anext__(self) -> Chunk:
        if self._given_up is not None:
            raise self._given_up
        if self._done:
            raise StopAsyncIteration
        first = self._num_chunks == 0
        phase = "first_token" if first else "stream_idle"
        timeout = self._deadlines.first_token_s if first else self._deadlines.stream_idle_s
        try:
            async with asyncio.timeout(timeout):   # no extra task per chunk, unlike wait_for
                msg = await self._call.read()
        except TimeoutError:
            self.cancel()
            raise WorkerCallError(self._address, phase, grpc.StatusCode.DEADLINE_EXCEEDED,
                                  f"no chunk within {timeout:g} s") from None
        except asyncio.CancelledError:
            # the read the give_up() below cut short; a cancel of our own task goes on
            task = asyncio.current_task()
            if self._given_up is not None and (task is None or not task.cancelling()):
                raise self._given_up from None
            raise
        except grpc.aio.AioRpcError as exc:
            self._done = True
            if self._given_up is not None:
                raise self._given_up from None
            raise WorkerCallError(self._address, phase, exc.code(), exc.details() or "",
                                  await _reached(self._call)) from None
        if self._given_up is not None:
            raise self._given_up
        if msg is grpc.aio.EOF:
            self._done = True
            raise StopAsyncIteration
        self._num_chunks += 1
        return chunk_from_proto(msg)

    def cancel(self) -> None:
        """Cancel the RPC; cancelling a Generate call aborts the request on the worker."""
        self._done = True
        self._call.cancel()

    def give_up(self, code: grpc.StatusCode, details: str) -> None:
        """End the stream from outside (its worker stopped advancing): the read waiting now,
        or the next one, fails with this status instead of waiting out its deadline."""
        if self._given_up is None and not self._done:
            self._given_up = WorkerCallError(self._address, "decode", code, details)
            self.cancel()


class WorkerClient:
    """Calls of the bulkhead.v1.Worker service on one address."""

    def __init__(self, address: str, deadlines: CallDeadlines,
                 access: WorkerAccess = WorkerAccess()) -> None:
        self.address = address
        self._deadlines = deadlines
        self._metadata = access.metadata
        self._channel = access.channel(
            address, options=[("grpc.enable_retries", 0),
                              ("grpc.max_receive_message_length", 64 * 1024 * 1024),
                              *RECONNECT_BACKOFF])
        self._stub = pb_grpc.WorkerStub(self._channel)

    async def _unary(self, method: Any, request: Any, phase: str, timeout: float) -> Any:
        call = method(request, timeout=timeout, metadata=self._metadata)
        try:
            answer = await call
        except grpc.aio.AioRpcError as exc:
            raise WorkerCallError(self.address, phase, exc.code(), exc.details() or "",
                                  await _reached(call)) from None
        if answer is None:
            # grpc.aio hands back None, not an error, when it cannot deserialize an answer
            # (grpc/_common.py `_transform` logs and swallows the exception) or when a call ends
            # OK with no message; read on, that was the router's `GetInfo failed:
            # AttributeError("'NoneType' object has no attribute 'worker_id'")` under load
            raise WorkerCallError(self.address, phase, grpc.StatusCode.UNKNOWN, EMPTY_ANSWER)
        return answer

    async def get_info(self) -> WorkerStatus:
        return status_from_proto(await self._unary(self._stub.GetInfo, pb.WorkerInfoRequest(),
                                                   "info", self._deadlines.info_s))

    async def lookup(self, prompt_token_ids: Sequence[int]) -> int:
        resp = await self._unary(self._stub.Lookup,
                                 pb.LookupRequest(prompt_token_ids=prompt_token_ids), "lookup",
                                 self._deadlines.info_s)
        return int(resp.num_cached_tokens)

    async def prefill(self, item: WorkItem) -> Prefilled:
        resp = await self._unary(self._stub.Prefill, prefill_request(item), "prefill",
                                 self._deadlines.prefill_s)
        return prefilled_from_proto(resp)

    def generate(self, item: WorkItem, after: Prefilled | None = None) -> GenerateStream:
        """Stream ``item``'s tokens; ``after``: the prefill this Generate continues."""
        return GenerateStream(
            self._stub.Generate(generate_request(item, after), metadata=self._metadata),
            self.address, self._deadlines)

    async def abort(self, request_id: str) -> bool:
        resp = await self._unary(self._stub.Abort, pb.AbortRequest(request_id=request_id),
                                 "abort", self._deadlines.info_s)
        return bool(resp.found)

    async def close(self) -> None:
        await self._channel.close(grace=None)
