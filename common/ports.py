"""Whether a server could bind a TCP port now: the check `bulkhead up` and the workers make before
they start anything, so a busy port is refused in a second, not after minutes of loading
weights."""

from __future__ import annotations

import socket


def port_in_use(host: str, port: int) -> bool:
    """Whether a server could not bind ``port`` on ``host`` now. SO_REUSEADDR as uvicorn binds,
    so a socket of a stopped server still in TIME_WAIT does not count as a user."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except OSError:
        return False  # an unresolvable host: the server's own bind will say so
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False
