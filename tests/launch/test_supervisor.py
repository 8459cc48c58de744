"""The supervisor restarts real child processes that die, with back-off, keeps the others
running, and gives up on a child that cannot start."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from launch.launcher import ProcessGroup, spawn
from launch.supervisor import GaveUp, RestartPolicy, Supervisor

pytestmark = pytest.mark.timeout(60)


def _sleeper(tmp: Path, name: str, code: str = "import time; time.sleep(60)"):
    return spawn(name, [sys.executable, "-c", code], log_dir=tmp)


def _run(sup: Supervisor, until, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline, "condition not reached"
        sup.poll(time.monotonic())
        time.sleep(0.05)


def test_a_killed_child_is_restarted_and_the_others_keep_running(tmp_path: Path) -> None:
    group = ProcessGroup()
    a = group.add(_sleeper(tmp_path, "a"))
    b = group.add(_sleeper(tmp_path, "b"))
    lines: list[str] = []
    sup = Supervisor(group, {"a": lambda: True, "b": lambda: True},
                     RestartPolicy(backoff_initial_s=0.2, backoff_max_s=1.0), lines.append,
                     time.monotonic())
    try:
        a.popen.kill()
        started = time.monotonic()
        _run(sup, lambda: any("a is serving again" in line for line in lines))
        assert time.monotonic() - started >= 0.2   # the back-off was waited
        new_a = group.processes[0]
        assert new_a.pid != a.pid and new_a.alive()
        assert group.processes[1] is b and b.alive()   # untouched
        assert any("a (pid" in line and "exited with code -9" in line for line in lines)
        # a second death in a row waits twice as long
        new_a.popen.kill()
        _run(sup, lambda: sum("restarting it in" in line for line in lines) == 2)
        assert "restarting it in 0.4 s" in lines[-1]
    finally:
        group.stop_all(grace_s=1)


def test_a_child_that_cannot_start_is_given_up_on(tmp_path: Path) -> None:
    group = ProcessGroup()
    c = group.add(_sleeper(tmp_path, "c"))
    lines: list[str] = []
    sup = Supervisor(group, {"c": lambda: False},
                     RestartPolicy(max_failed_starts=3, backoff_initial_s=0.05,
                                   backoff_max_s=0.1, startup_timeout_s=0.3),
                     lines.append, time.monotonic())
    try:
        c.popen.kill()
        with pytest.raises(GaveUp, match="c failed to start 3 times in a row"):
            _run(sup, lambda: False)
        assert sup.restarts == 3
    finally:
        group.stop_all(grace_s=1)


def test_restart_keeps_the_log(tmp_path: Path) -> None:
    group = ProcessGroup()
    d = group.add(spawn("d", [sys.executable, "-c", "print('first run', flush=True)"],
                        log_dir=tmp_path))
    d.popen.wait(10)
    sup = Supervisor(group, {"d": lambda: True},
                     RestartPolicy(backoff_initial_s=0.05), lambda _: None, time.monotonic())
    try:
        _run(sup, lambda: sup.restarts >= 1 and not group.processes[0].alive())
        assert (tmp_path / "d.log").read_text().count("first run") == 2
    finally:
        group.stop_all(grace_s=1)
