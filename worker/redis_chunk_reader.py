"""Reading LMCache's chunks back out of Redis straight into a host tensor, without LMCache.

Why not LMCache's own read: its Redis connector (0.5.6) GETs each chunk through redis.asyncio on
one event-loop thread, parses the reply in Python (the bulk string is copied out of the stream
buffer, sliced, then copied again into a memory object) and our connector copies it once more
into the staging tensor: 0.34 GB/s on the H200 host, 0.48 GB/s on a 2-core CPU, against a host
memcpy of 12-47 GB/s. And a retrieve holds LMCache's engine for the whole prompt, so a worker
that serialises its calls to it makes every other request's lookup wait behind a long fetch.

Here each chunk's value is read with ``socket.recv_into`` directly into its rows of the staging
tensor (no intermediate copy when blocks carry no padding), over several connections at once
(``recv_into`` releases the GIL), each keeping two GETs in flight so the server is never idle
between replies but never queues more than two chunks per connection in its output buffers.
No LMCache state is touched, so reads and lookups run alongside anything the LMCache engine does.

What it relies on of LMCache's Redis layout (checked by the round-trip tests): a chunk is the
two keys ``key + "kv_bytes"`` (the raw bytes of the chunk's memory object, "naive" serde) and
``key + "metadata"`` (a struct of int32 whose first field is that length), and the metadata
key is written after the bytes, so a present metadata key means the chunk was fully stored
(unless Redis evicted its bytes since: then the read stops at that chunk).

Never writes, never deletes, never decides what to recompute: it says how many leading chunks
it read, the caller recomputes the rest.
"""

from __future__ import annotations

import logging
import queue
import struct
import threading
from collections.abc import Sequence
from typing import Any

from common.redact import redact_text

log = logging.getLogger(__name__)

KV_SUFFIX, META_SUFFIX = "kv_bytes", "metadata"
_RECV_BYTES = 1 << 16  # what one recv() of a reply's header line may take


class ReplyError(RuntimeError):
    """Redis answered with an error, or with something that is not a bulk string."""


class _Replies:
    """RESP replies read off one socket; bulk strings land in the caller's buffer."""

    def __init__(self, sock: Any) -> None:  # noqa: ANN401 - a socket or an SSLSocket
        self._sock = sock
        self._pending = bytearray()  # bytes received past the last reply consumed

    def _fill(self) -> None:
        data = self._sock.recv(_RECV_BYTES)
        if not data:
            raise ConnectionError("the KV store closed the connection")
        self._pending += data

    def _line(self) -> bytes:
        while (end := self._pending.find(b"\r\n")) < 0:
            self._fill()
        line = bytes(self._pending[:end])
        del self._pending[: end + 2]
        return line

    def _exact_into(self, dest: memoryview) -> None:
        n = len(dest)
        got = min(n, len(self._pending))
        dest[:got] = self._pending[:got]
        del self._pending[:got]
        while got < n:
            r = self._sock.recv_into(dest[got:], n - got)
            if r == 0:
                raise ConnectionError("the KV store closed the connection mid-reply")
            got += r

    def bulk_into(self, dest: memoryview) -> bool:
        """Read one bulk-string reply into ``dest``; False when the key is absent or its value
        is not ``len(dest)`` bytes long (the value is then read and dropped)."""
        header = self._line()
        if header[:1] == b"-":
            raise ReplyError(header[1:].decode(errors="replace"))
        if header == b"_":  # RESP3's null (a connection that said HELLO 3): the key is absent
            return False
        if header[:1] != b"$":
            raise ReplyError(f"expected a bulk string, got {header[:32]!r}")
        n = int(header[1:])
        if n < 0:
            return False
        if n != len(dest):
            self._exact_into(memoryview(bytearray(n)))
        else:
            self._exact_into(dest)
        self._exact_into(memoryview(bytearray(2)))  # the reply's trailing CRLF
        return n == len(dest)


class RedisChunkReader:
    """Lookups and parallel chunk reads against the Redis server LMCache writes to.

    Thread-safe: every call takes its own connections from a pool."""

    def __init__(self, url: str, *, num_connections: int = 4, timeout_s: float = 10.0) -> None:
        import redis

        assert num_connections >= 1
        self.num_connections = num_connections
        # Same URL handling (password, TLS, db) as the store's other clients. Reads share a
        # bounded pool (concurrent fetches wait for a connection rather than fail, and never
        # open more than 4 fetches' worth); lookups have their own, so they never wait for one.
        opts = {"socket_timeout": timeout_s, "socket_connect_timeout": 5.0}
        self._pool = redis.BlockingConnectionPool.from_url(
            url, max_connections=4 * num_connections, timeout=timeout_s, **opts)
        self._client = redis.Redis(connection_pool=redis.ConnectionPool.from_url(url, **opts))

    def close(self) -> None:
        self._client.close()
        self._client.connection_pool.disconnect()
        self._pool.disconnect()

    def stored_lengths(self, keys: Sequence[str]) -> list[int]:
        """The stored byte length of each of the leading chunks of ``keys`` whose metadata is
        present (one round trip); stops at the first absent one."""
        if not keys:
            return []
        import redis

        try:
            metas = self._client.mget([k + META_SUFFIX for k in keys])
        except (redis.RedisError, OSError) as exc:
            # a store that is down holds nothing we can load (as LMCache's lookup answers);
            # the caller recomputes, and wait_visible probes reachability itself
            log.warning("KV store lookup failed, counting nothing stored: %s",
                        redact_text(str(exc)))
            return []
        lengths = []
        for meta in metas:
            if meta is None or len(meta) < 4:
                break
            lengths.append(struct.unpack_from("i", meta)[0])
        return lengths

    def read(self, keys: Sequence[str], dests: Sequence[memoryview]) -> int:
        """Read chunk ``keys[i]``'s bytes into ``dests[i]`` (exactly ``len(dests[i])`` bytes);
        returns how many leading chunks were read whole. A chunk missing, of another length,
        or lost to a connection error ends the prefix there."""
        assert len(keys) == len(dests)
        if not keys:
            return 0
        ok = [False] * len(keys)
        work: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        # Stripes of consecutive chunks: each connection pipelines its own stripe.
        num = min(self.num_connections, len(keys))
        stripe = -(-len(keys) // num)
        for s in range(0, len(keys), stripe):
            work.put((s, min(s + stripe, len(keys))))
        errors: list[BaseException] = []

        def reader() -> None:
            while True:
                try:
                    lo, hi = work.get_nowait()
                except queue.Empty:
                    return
                try:
                    self._read_stripe(keys, dests, lo, hi, ok)
                except Exception as exc:  # noqa: BLE001 - the prefix stops at the failed chunk
                    errors.append(exc)

        threads = [threading.Thread(target=reader, name=f"kv-read-{i}", daemon=True)
                   for i in range(num - 1)]
        for t in threads:
            t.start()
        reader()  # the calling thread reads a stripe too
        for t in threads:
            t.join()
        if errors:
            log.warning("KV store read: %d of %d stripes failed: %s", len(errors), num,
                        errors[0])
        n = 0
        while n < len(ok) and ok[n]:
            n += 1
        return n

    def _read_stripe(self, keys: Sequence[str], dests: Sequence[memoryview], lo: int, hi: int,
                     ok: list[bool]) -> None:
        conn = self._pool.get_connection()
        clean = False
        try:
            conn.connect()
            # redis-py has read every reply to what it sent (AUTH, HELLO, ...); the socket holds
            # nothing more, so from here on its bytes are ours to parse.
            replies = _Replies(conn._sock)
            sent = lo
            for i in range(lo, hi):
                while sent < min(i + 2, hi):  # two GETs in flight on this connection
                    conn.send_packed_command(conn.pack_command("GET", keys[sent] + KV_SUFFIX))
                    sent += 1
                if not replies.bulk_into(dests[i]):
                    # an absent or resized chunk: drain the reply in flight and stop here
                    for _ in range(i + 1, sent):
                        replies.bulk_into(memoryview(bytearray(0)))
                    break
                ok[i] = True
            clean = True
        finally:
            if not clean:
                conn.disconnect()  # a half-read reply must never reach the pool's next user
            self._pool.release(conn)
