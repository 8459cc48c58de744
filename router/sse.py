"""Server-sent events and client-disconnect detection for the ASGI edge.

`EventStreamResponse` sends an async iterator of SSE strings and, at the same time, listens for
the client going away; when it does, the iterator is cancelled (its clean-up cancels the worker
calls and sends Abort).  `run_until_disconnect` does the same for a non-streamed answer.  These
are plain asyncio tasks, not anyio cancel scopes, so clean-up code may still await.  This module
must never swallow an error of the iterator without logging it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

log = logging.getLogger("bulkhead.router.sse")
T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(work: Awaitable[T], receive: Receive) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watch.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


class EventStreamResponse(Response):
    """A text/event-stream answer that cancels its producer when the client disconnects."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], headers: dict[str, str] | None = None) -> None:
        # Response.__init__ would add content-length: 0; a stream has none.
        self.events = events
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"),
                            (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
        self.raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]

    async def _pump(self, send: Send) -> None:
        try:
            async for item in self.events:
                await send({"type": "http.response.body", "body": item.encode(),
                            "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            aclose: Any = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        pump = asyncio.ensure_future(self._pump(send))
        watch = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (pump, watch):
                if not t.done():
                    t.cancel()
            await asyncio.gather(pump, watch, return_exceptions=True)
        if not pump.cancelled() and pump.exception() is not None:
            log.error("event stream failed: %r", pump.exception())
