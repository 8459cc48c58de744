"""The router's HTTP/1.1 protocol: uvicorn's h11 one, with the answer to a request head past
``max_header_bytes`` made a 431 that the client can read.

uvicorn answers every h11 protocol error with a 400 and closes the socket at once. For a head
that is too large the client is usually still sending it; closing with its bytes unread makes the
kernel reset the connection, so the client saw a reset, not an answer. Here that answer is 431
(h11's own status hint), and the connection drains what the client still sends for up to
``LINGER_S`` before it closes. This module never parses a request itself.
"""

from __future__ import annotations

from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

LINGER_S = 2.0  # how long a refused connection reads and drops what the client still sends


class EdgeH11Protocol(H11Protocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._error_status = 400
        self._draining = False
        next_event = self.conn.next_event

        def checked_next_event() -> Any:
            try:
                return next_event()
            except h11.RemoteProtocolError as exc:
                self._error_status = exc.error_status_hint
                raise

        self.conn.next_event = checked_next_event  # type: ignore[method-assign]

    def data_received(self, data: bytes) -> None:
        if self._draining:
            return  # the answer is out: what the client still sends is dropped
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        if self._error_status != 431:
            super().send_400_response(msg)
            return
        body = (b"Request header fields too large: the request head is larger than the "
                b"router's max_header_bytes.")
        event = h11.Response(status_code=431, reason=b"Request Header Fields Too Large",
                             headers=[(b"content-type", b"text/plain; charset=utf-8"),
                                      (b"content-length", str(len(body)).encode()),
                                      (b"connection", b"close")])
        self.transport.write(self.conn.send(event))
        self.transport.write(self.conn.send(h11.Data(data=body)))
        self.transport.write(self.conn.send(h11.EndOfMessage()))
        self._draining = True
        self.loop.call_later(LINGER_S, self.transport.close)
