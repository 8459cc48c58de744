"""Keeps the processes of a local deployment running: a child that dies is restarted.

``bulkhead up`` hands its `ProcessGroup` and one readiness probe per child to a `Supervisor` and
calls `poll()` twice a second.  A child that exits is logged and started again with the same
command line, environment and port, after a back-off that doubles with each death in a row
(``backoff_initial_s`` .. ``backoff_max_s``) and resets once the child has stayed up for
``stable_after_s``; the others keep serving meanwhile.  A restarted child counts as started once
its probe answers; one that dies or is not ready within ``startup_timeout_s`` is a failed
start, and ``max_failed_starts`` of those in a row raise `GaveUp` (the caller then stops the
group): a child that cannot start is reported, not retried forever.

This module never kills a process it did not start and never imports torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from launch.launcher import ManagedProcess, ProcessGroup, spawn


class GaveUp(RuntimeError):
    """A child failed to start `max_failed_starts` times in a row."""


@dataclass(frozen=True)
class RestartPolicy:
    max_failed_starts: int = 5
    backoff_initial_s: float = 0.25  # a first death costs little; a crash loop still backs off
    backoff_max_s: float = 30.0
    stable_after_s: float = 60.0
    startup_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.max_failed_starts < 1:
            raise ValueError(f"max_failed_starts: {self.max_failed_starts} must be >= 1")
        if not 0 < self.backoff_initial_s <= self.backoff_max_s:
            raise ValueError(f"backoff: need 0 < backoff_initial_s ({self.backoff_initial_s}) "
                             f"<= backoff_max_s ({self.backoff_max_s})")

    def backoff_s(self, deaths_in_a_row: int) -> float:
        return min(self.backoff_initial_s * 2 ** max(deaths_in_a_row - 1, 0), self.backoff_max_s)


@dataclass
class _Child:
    """What the supervisor knows of one child between polls."""

    index: int                 # position in the group, so a restart replaces it in place
    state: str                 # "running" | "starting" | "waiting"
    since_s: float             # when it entered that state
    restart_at_s: float = 0.0
    deaths_in_a_row: int = 0
    failed_starts: int = 0


class Supervisor:
    """Restarts the dead children of ``group``; ``ready[name]()`` says a child is serving."""

    def __init__(self, group: ProcessGroup, ready: Mapping[str, Callable[[], bool]],
                 policy: RestartPolicy, log: Callable[[str], None], now_s: float) -> None:
        self.group = group
        self.ready = dict(ready)
        self.policy = policy
        self.log = log
        self.restarts = 0
        self._children = {p.name: _Child(i, "running", now_s)
                          for i, p in enumerate(group.processes)}

    def _proc(self, name: str) -> ManagedProcess:
        return self.group.processes[self._children[name].index]

    def poll(self, now_s: float) -> None:
        """One round: notice deaths, start what is due, promote children whose probe answers."""
        for name, child in self._children.items():
            proc = self._proc(name)
            if child.state == "running":
                if proc.alive():
                    if now_s - child.since_s >= self.policy.stable_after_s:
                        child.deaths_in_a_row = 0
                    continue
                child.deaths_in_a_row += 1
                self._schedule(name, child, now_s, f"exited with code {proc.popen.returncode}")
            elif child.state == "waiting":
                if now_s >= child.restart_at_s:
                    self._start(name, child, now_s)
            elif child.state == "starting":
                self._check_start(name, child, now_s)

    def _schedule(self, name: str, child: _Child, now_s: float, why: str) -> None:
        proc = self._proc(name)
        proc.stop(grace_s=5.0)   # sweep its process group before the port is taken again
        delay = self.policy.backoff_s(child.deaths_in_a_row)
        child.state, child.since_s, child.restart_at_s = "waiting", now_s, now_s + delay
        self.log(f"bulkhead up: {name} (pid {proc.pid}) {why}; restarting it in {delay:g} s "
                 f"(the others keep serving). Log tail:\n{proc.log_tail(1500)}")

    def _start(self, name: str, child: _Child, now_s: float) -> None:
        old = self._proc(name)
        log_dir = old.log_path.parent if old.log_path is not None else None
        new = spawn(name, old.argv, env=old.env, log_dir=log_dir, append_log=True)
        self.group.processes[child.index] = new
        self.restarts += 1
        child.state, child.since_s = "starting", now_s
        self.log(f"bulkhead up: {name} restarted (pid {new.pid})")

    def _check_start(self, name: str, child: _Child, now_s: float) -> None:
        proc = self._proc(name)
        if not proc.alive():
            self._failed_start(name, child, now_s, f"exited with code {proc.popen.returncode} "
                               "while starting")
        elif self.ready[name]():
            child.state, child.since_s, child.failed_starts = "running", now_s, 0
            self.log(f"bulkhead up: {name} is serving again (pid {proc.pid})")
        elif now_s - child.since_s > self.policy.startup_timeout_s:
            self._failed_start(name, child, now_s, "was not ready within "
                               f"{self.policy.startup_timeout_s:g} s")

    def _failed_start(self, name: str, child: _Child, now_s: float, why: str) -> None:
        child.failed_starts += 1
        child.deaths_in_a_row += 1
        if child.failed_starts >= self.policy.max_failed_starts:
            proc = self._proc(name)
            raise GaveUp(f"{name} failed to start {child.failed_starts} times in a row "
                         f"(last: {why}); log tail:\n{proc.log_tail()}")
        self._schedule(name, child, now_s, why)
