"""The router as its own process (`python -m router.server`, the real SmolLM2 tokenizer), in
front of fake gRPC workers served from the test process: what the edge tests attack.

A separate process, so its RSS can be read and a stall inside it shows up as gaps in the
streams the test reads over loopback.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx

from common.default_model import default_model_path
from launch.launcher import free_port
from proto import bulkhead_pb2_grpc as pb_grpc
from tests.router.router_fakes import FakeWorker, LoopThread

MODEL = "tiny"
# The fakes must accept the 1M-token prompts a 4 MB body tokenizes to.
_BIG_MESSAGES = [("grpc.max_receive_message_length", 64 * 1024 * 1024),
                 ("grpc.max_send_message_length", 64 * 1024 * 1024)]


async def start_big_worker(worker: FakeWorker) -> grpc.aio.Server:
    server = grpc.aio.server(options=_BIG_MESSAGES)
    pb_grpc.add_WorkerServicer_to_server(worker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    worker.address = f"127.0.0.1:{port}"
    await server.start()
    return server


@dataclass
class EdgeRouter:
    base_url: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    prefill: FakeWorker
    decode: FakeWorker

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def http(self, timeout: float = 30.0) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextmanager
def edge_router(loop: LoopThread, tmp: Path, *, max_context: int, max_body_bytes: int,
                token_delay_s: float = 0.02, extra_args: tuple[str, ...] = ()
                ) -> Iterator[EdgeRouter]:
    """Fakes (one prefill, one decode) with `max_context`, and a router process on them."""
    script = list(range(300, 340))   # SmolLM2 ids: plain word pieces
    prefill = FakeWorker("prefill", script, 2, max_context=max_context, max_queue=64,
                         token_delay_s=token_delay_s)
    decode = FakeWorker("decode", script, 2, max_context=max_context, max_queue=64,
                        token_delay_s=token_delay_s)
    servers = [loop.run(start_big_worker(w)) for w in (prefill, decode)]
    port = free_port()
    log_path = tmp / "router.log"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
           "LMCACHE_TRACK_USAGE": "false", "PYTHONHASHSEED": "0"}
    argv = [sys.executable, "-m", "router.server", "--model", str(default_model_path()),
            "--served-model-name", MODEL, "--port", str(port), "--prefill", prefill.address,
            "--decode", decode.address, "--poll-interval-s", "0.5",
            "--max-body-bytes", str(max_body_bytes), "--split-threshold-tokens", "64",
            *extra_args]
    with log_path.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    router = EdgeRouter(f"http://127.0.0.1:{port}", port, proc, log_path, prefill, decode)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, router.log()
            assert time.monotonic() < deadline, router.log()
            try:
                if httpx.get(router.base_url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield router
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        for s in servers:
            loop.run(s.stop(grace=None))


def send_raw(port: int, head: bytes, body_chunks: Iterator[bytes], timeout_s: float = 10.0
             ) -> tuple[int, bytes, float]:
    """Send a request head and body chunks over a raw socket, stopping the body as soon as an
    answer arrives (as a server refusing early lets a client do): (status, answer, seconds)."""
    started = time.monotonic()
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(head)
        sock.setblocking(False)
        for chunk in body_chunks:
            view = memoryview(chunk)
            while view:
                answer += _read_some(sock)
                if answer:
                    break
                try:
                    sent = sock.send(view)
                    view = view[sent:]
                except BlockingIOError:
                    time.sleep(0.001)
                except (BrokenPipeError, ConnectionResetError):
                    break
                if time.monotonic() - started > timeout_s:
                    raise TimeoutError("the server neither read the body nor answered")
            if answer:
                break
        sock.setblocking(True)
        sock.settimeout(max(0.1, timeout_s - (time.monotonic() - started)))
        while b"\r\n\r\n" not in answer or not _complete(answer):
            try:
                more = sock.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not more:
                break
            answer += more
    elapsed = time.monotonic() - started
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/") else 0
    return status, answer, elapsed


def _read_some(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except (BlockingIOError, InterruptedError):
        return b""
    except ConnectionResetError:
        return b""


def _complete(answer: bytes) -> bool:
    head, _, body = answer.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":", 1)[1])
    return True
