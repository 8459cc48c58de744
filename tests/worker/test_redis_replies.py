"""The chunk reader's RESP parsing: absent keys in RESP2 and RESP3, sizes, errors."""

from __future__ import annotations

import socket

import pytest

from worker.redis_chunk_reader import ReplyError, _Replies


def _replies(raw: bytes) -> _Replies:
    a, b = socket.socketpair()
    a.sendall(raw)
    a.close()
    return _Replies(b)


def test_absent_keys_in_either_protocol_then_a_value() -> None:
    # RESP2 null, RESP3 null (seen on the H200 when Redis evicted a chunk), then 3 bytes
    r = _replies(b"$-1\r\n_\r\n$3\r\nabc\r\n$3\r\nxyz\r\n$1\r\nq\r\n")
    buf = bytearray(3)
    assert r.bulk_into(memoryview(buf)) is False
    assert r.bulk_into(memoryview(buf)) is False
    assert r.bulk_into(memoryview(buf)) is True and bytes(buf) == b"abc"
    # a value of another length is read past (the stream stays in step) and refused
    assert r.bulk_into(memoryview(bytearray(2))) is False
    one = bytearray(1)
    assert r.bulk_into(memoryview(one)) is True and bytes(one) == b"q"


def test_errors_and_other_types_are_named() -> None:
    with pytest.raises(ReplyError, match="WRONGTYPE"):
        _replies(b"-WRONGTYPE Operation against a key\r\n").bulk_into(memoryview(bytearray(1)))
    with pytest.raises(ReplyError, match="expected a bulk string"):
        _replies(b":12\r\n").bulk_into(memoryview(bytearray(1)))
