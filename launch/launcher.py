"""Starting, watching and stopping the OS processes of a local Bulkhead deployment.

Used by ``bulkhead up`` and by the end-to-end tests: each child runs in its own session (process
group), its output goes to a log file, and ``stop()`` ends the whole group (SIGTERM, then SIGKILL
after a grace period) so no grandchild is left behind. Also starts the KV store a deployment
needs when none is given: ``redis-server`` on a free loopback port if installed, else LMCache's
own ``lm://`` server.

This module never imports torch or LMCache (the launcher process stays small) and never kills a
process it did not start.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path


class LaunchError(RuntimeError):
    """A child process could not be started, died early, or did not become ready in time."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def tcp_open(host: str, port: int, timeout_s: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


@dataclass
class ManagedProcess:
    """One child process in its own process group, with its log file."""

    name: str
    argv: list[str]
    popen: subprocess.Popen[bytes]
    log_path: Path | None
    env: dict[str, str] = field(default_factory=dict)  # what spawn added to os.environ

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, num_chars: int = 4000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        data = self.log_path.read_bytes()[-num_chars:]
        return data.decode(errors="replace")

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the process group, wait ``grace_s``, then SIGKILL it. Returns the exit code."""
        if self.alive():
            self._signal_group(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=grace_s)
        # The leader may be gone while a grandchild of its group lives on: always sweep.
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=5.0)
        return self.popen.returncode

    def _signal_group(self, sig: int) -> None:
        # start_new_session=True made the child leader of a group whose id is its pid.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)


def _die_with_parent() -> None:
    """preexec_fn: Linux sends the child SIGTERM when the launcher dies, even by SIGKILL, so a
    crashed ``bulkhead up`` leaves no orphans. A no-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def spawn(
    name: str,
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    log_dir: Path | None = None,
    cwd: str | None = None,
    append_log: bool = False,
) -> ManagedProcess:
    """Start ``argv`` in a new session; stdout+stderr go to ``log_dir/name.log`` (or inherit);
    ``append_log`` keeps what an earlier run of the same child wrote there (a restart)."""
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    log_path = None
    out: int | object = None
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{name}.log"
        out = log_path.open("ab" if append_log else "wb")
    try:
        popen = subprocess.Popen(
            list(argv),
            env=full_env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=out if log_path else None,  # type: ignore[arg-type]
            stderr=subprocess.STDOUT if log_path else None,
            start_new_session=True, preexec_fn=_die_with_parent,
        )
    except OSError as e:
        raise LaunchError(f"{name}: cannot start {argv[0]!r}: {e}") from e
    finally:
        if log_path is not None:
            out.close()  # type: ignore[union-attr]
    return ManagedProcess(name=name, argv=list(argv), popen=popen, log_path=log_path,
                          env=dict(env or {}))


def wait_until(
    proc: ManagedProcess, ready: Callable[[], bool], timeout_s: float, what: str
) -> None:
    """Poll ``ready()`` until true; raise LaunchError (with the log tail) if ``proc`` dies or
    ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    delay = 0.05
    while True:
        if not proc.alive():
            raise LaunchError(
                f"{proc.name} exited with code {proc.popen.returncode} before {what}; "
                f"log tail:\n{proc.log_tail()}"
            )
        if ready():
            return
        if time.monotonic() > deadline:
            raise LaunchError(
                f"{proc.name} not {what} after {timeout_s:.0f} s; log tail:\n{proc.log_tail()}"
            )
        time.sleep(delay)
        delay = min(delay * 1.5, 0.5)


# ---------------------------------------------------------------------- KV store servers
def redis_server_path() -> str | None:
    return shutil.which("redis-server")


def start_redis(
    port: int | None = None,
    *,
    host: str = "127.0.0.1",
    maxmemory_mb: int = 1024,
    log_dir: Path | None = None,
    timeout_s: float = 15.0,
    io_threads: int = 1,
) -> tuple[ManagedProcess, str]:
    """Start an in-memory redis-server (no persistence, LRU-bounded) and return it and its URL.
    ``io_threads`` > 1 lets Redis read and write its clients' sockets on that many threads (its
    main thread writes at most 64 KiB to a client per pass of its event loop, which bounds a
    large fetch; whether threads lift it for KV handoffs is not measured yet)."""
    if io_threads < 1:
        raise LaunchError(f"redis io_threads must be >= 1, got {io_threads}")
    exe = redis_server_path()
    if exe is None:
        raise LaunchError("redis-server is not installed (apt-get install redis-server)")
    port = port or free_port(host)
    argv = [
        exe,
        "--port",
        str(port),
        "--bind",
        host,
        "--save",
        "",
        "--appendonly",
        "no",
        "--maxmemory",
        f"{maxmemory_mb}mb",
        "--maxmemory-policy",
        "allkeys-lru",
        "--protected-mode",
        "no",
    ]
    if io_threads > 1:
        argv += ["--io-threads", str(io_threads), "--io-threads-do-reads", "yes"]
    proc = spawn("redis", argv, log_dir=log_dir)
    wait_until(proc, lambda: tcp_open(host, port), timeout_s, f"listening on {host}:{port}")
    return proc, f"redis://{host}:{port}"


def start_lm_server(
    port: int | None = None,
    *,
    host: str = "127.0.0.1",
    log_dir: Path | None = None,
    timeout_s: float = 60.0,
) -> tuple[ManagedProcess, str]:
    """Start LMCache's own TCP store (in memory, no eviction) and return it and its URL."""
    port = port or free_port(host)
    argv = [sys.executable, "-m", "lmcache.v1.server", host, str(port), "cpu"]
    proc = spawn("lm-server", argv, env={"LMCACHE_TRACK_USAGE": "false"}, log_dir=log_dir)
    wait_until(proc, lambda: tcp_open(host, port), timeout_s, f"listening on {host}:{port}")
    return proc, f"lm://{host}:{port}"


def start_kv_server(
    *, host: str = "127.0.0.1", log_dir: Path | None = None
) -> tuple[ManagedProcess, str]:
    """redis-server if installed, else LMCache's lm:// server."""
    if redis_server_path() is not None:
        return start_redis(host=host, log_dir=log_dir)
    return start_lm_server(host=host, log_dir=log_dir)


@dataclass
class ProcessGroup:
    """Processes started together and stopped together, last started first stopped."""

    processes: list[ManagedProcess] = field(default_factory=list)

    def add(self, proc: ManagedProcess) -> ManagedProcess:
        self.processes.append(proc)
        return proc

    def first_dead(self) -> ManagedProcess | None:
        return next((p for p in self.processes if not p.alive()), None)

    def stop_all(self, grace_s: float = 10.0) -> None:
        # Send SIGTERM to all first so they shut down in parallel, then wait for each.
        for proc in reversed(self.processes):
            if proc.alive():
                proc._signal_group(signal.SIGTERM)
        for proc in reversed(self.processes):
            proc.stop(grace_s)
        self.processes.clear()

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()
