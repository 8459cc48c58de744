"""`bulkhead up` as a child process for end-to-end tests: started in its own session with its
output in a file, waited on until it prints its banner, and never left behind (killed as a group
if the test fails before it stopped it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

READY_LINE = "Ctrl-C stops everything"


@contextmanager
def up_process(args: list[str], out_path: Path, env: Mapping[str, str]
               ) -> Iterator[subprocess.Popen[bytes]]:
    """Runs `python -m launch.cli up ARGS`, stdout and stderr into `out_path`."""
    with out_path.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "launch.cli", "up", *args],
                                stdout=out, stderr=subprocess.STDOUT, env=dict(env),
                                start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def log_tails(log_dir: Path | None, lines: int = 30) -> str:
    """The last ``lines`` lines of each process log `up` wrote in ``log_dir`` (the workers',
    the router's, the KV store's): what a failed start was doing."""
    if log_dir is None or not log_dir.is_dir():
        return ""
    parts = []
    for log in sorted(log_dir.glob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {log.name} (last {len(tail)} lines)\n" + "\n".join(tail))
    return "\n".join(parts)


def wait_until_up(proc: subprocess.Popen[bytes], out_path: Path, budget_s: float,
                  poll_s: float = 0.5, log_dir: Path | None = None) -> float:
    """Waits for the banner; fails with the output so far, and the tail of each process log
    in ``log_dir``, if `up` exits or `budget_s` passes. Returns the seconds waited."""
    started = time.monotonic()
    while READY_LINE not in out_path.read_text():
        if proc.poll() is not None:
            raise AssertionError(f"up exited with {proc.returncode}:\n{out_path.read_text()}\n"
                                 f"{log_tails(log_dir)}")
        if time.monotonic() - started >= budget_s:
            raise AssertionError(f"not healthy after {budget_s:.0f} s (the start-up budget, "
                                 f"tests/helpers/startup_budget.py):\n{out_path.read_text()}\n"
                                 f"{log_tails(log_dir)}")
        time.sleep(poll_s)
    return time.monotonic() - started


def stop_up(proc: subprocess.Popen[bytes], out_path: Path) -> None:
    """Ctrl-C, as a user stops it: everything must exit cleanly."""
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0, out_path.read_text()
