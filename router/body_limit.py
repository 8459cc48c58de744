"""A request-body size limit enforced as the bytes arrive, before anything parses them.

Pure ASGI middleware: a declared ``Content-Length`` over the limit is answered 413 without
reading a byte of the body; a chunked (or lying) body is counted message by message as the app
pulls it, and the moment the count passes the limit the client gets the 413, the app sees a
disconnect and whatever it then tries to send is dropped.  So no request can make the router
hold more than ``max_body_bytes`` of its body, however it is framed. A request framed two ways
(both Transfer-Encoding and Content-Length) is refused with a 400 before anything reads it.  This module must never
buffer a body and never import torch.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send


def _too_large_body(limit: int, seen: str) -> bytes:
    return json.dumps({"error": {
        "message": f"The request body is larger than the limit of {limit} bytes ({seen}); "
                   "send a shorter prompt.",
        "type": "invalid_request_error", "param": "body", "code": "request_too_large"}},
        separators=(",", ":")).encode()


class BodyLimitMiddleware:
    """413 for any request whose body exceeds ``max_bytes``."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def _refuse(self, send: Send, seen: str) -> None:
        await _answer(send, 413, _too_large_body(self.max_bytes, seen))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _has_both_framings(scope):
            # RFC 9112 6.1: a server may reject such a request, and must close the connection
            # after it; a request framed two ways is how request smuggling starts.
            await _answer(send, 400, json.dumps({"error": {
                "message": "The request has both Transfer-Encoding and Content-Length; send "
                           "one.", "type": "invalid_request_error", "param": "body",
                "code": "ambiguous_framing"}}, separators=(",", ":")).encode())
            return
        await self._limited(scope, receive, send)

    async def _limited(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(send, f"Content-Length is {declared}")
            return
        num_bytes = 0
        refused = False
        response_started = False

        async def counted_receive() -> Message:
            nonlocal num_bytes, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                num_bytes += len(message.get("body", b""))
                if num_bytes > self.max_bytes:
                    refused = True
                    if not response_started:
                        await self._refuse(send, f"more than {self.max_bytes} bytes arrived")
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal response_started
            if refused:
                return   # the 413 went out; the app's answer to the "disconnect" is dropped
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        await self.app(scope, counted_receive, guarded_send)


async def _answer(send: Send, status: int, body: bytes) -> None:
    # connection: close, since the rest of the body is never read off this connection
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _has_both_framings(scope: Scope) -> bool:
    names = {name for name, _ in scope.get("headers", ())}
    return b"content-length" in names and b"transfer-encoding" in names


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None   # the HTTP server refuses a malformed length before we run
    return None

