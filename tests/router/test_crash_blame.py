"""Who is blamed when a worker dies under several requests (router/crash_blame.py): the only
request running there at once; one of several only at its second crash within the window;
the n choices of one request are one suspect; calls begun after the crash are not suspects."""

from __future__ import annotations

import grpc

from router.crash_blame import CrashBlame, is_crash
from router.errors import WorkerCallError

A, B = "10.0.0.1:1", "10.0.0.2:1"


def err(details: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
        reached: bool = True) -> WorkerCallError:
    return WorkerCallError(A, "prefill", code, details, reached)


def test_a_crash_is_a_call_cut_by_the_workers_death_not_an_unreachable_worker() -> None:
    assert is_crash(err("Socket closed"))
    assert is_crash(err("recvmsg:Connection reset by peer"))
    assert is_crash(err("engine loop failed: RuntimeError: boom"))
    assert not is_crash(err("failed to connect to all addresses; last error: UNKNOWN: "
                            "ipv4:127.0.0.1:5: Failed to connect to remote host: Connection "
                            "refused"))
    assert not is_crash(err("the worker stopped advancing: no step for 10 s"))
    assert not is_crash(err("Socket closed", grpc.StatusCode.INTERNAL))
    # sent on a connection whose worker had just died: its handler never took the call
    assert not is_crash(err("recvmsg:Connection reset by peer", reached=False))


def test_the_only_request_running_is_blamed_at_once() -> None:
    blame = CrashBlame()
    t = blame.begin(A, "x")
    v = blame.crashed(t)
    assert v.blamed and v.num_suspects == 1


def test_the_choices_of_one_request_are_one_suspect() -> None:
    blame = CrashBlame()
    tickets = [blame.begin(A, "x") for _ in range(3)]
    verdicts = [blame.crashed(t) for t in tickets]
    assert all(v.blamed and v.num_suspects == 1 for v in verdicts)
    assert verdicts[-1].num_crashes == 1  # one crash, however many of its calls it cut


def test_bystanders_of_one_crash_are_not_blamed_and_a_second_crash_blames() -> None:
    now = [0.0]
    blame = CrashBlame(window_s=60.0, clock=lambda: now[0])
    x, y = blame.begin(A, "x"), blame.begin(A, "y")
    vx = blame.crashed(x)
    blame.end(x)  # x's runner is done before y's reports: y still counts x as a suspect
    vy = blame.crashed(y)
    blame.end(y)
    assert not vx.blamed and not vy.blamed and vx.num_suspects == vy.num_suspects == 2
    # a call that begins on the restarted worker is not a suspect of the old crash
    late = blame.begin(A, "z")
    assert late.generation == x.generation + 1
    blame.end(late)
    # x, retried by its client, is running at the next crash too (beside w): blamed
    now[0] = 30.0
    x2, w = blame.begin(B, "x"), blame.begin(B, "w")
    assert blame.crashed(x2).blamed
    assert not blame.crashed(w).blamed
    # outside the window the first crash is forgotten
    now[0] = 200.0
    y2, v = blame.begin(B, "y"), blame.begin(B, "v")
    assert not blame.crashed(y2).blamed and not blame.crashed(v).blamed


def test_ended_calls_are_forgotten() -> None:
    blame = CrashBlame()
    for _ in range(100):
        blame.end(blame.begin(A, "x"))
    assert blame._running == {}
