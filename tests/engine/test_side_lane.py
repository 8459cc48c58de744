"""The side lane's bookkeeping (engine/side_lane.py) and the Workspace it carves: what keeps two
streams' scratch, counters and shared state apart. CPU: no stream, issue order; the checks run
the same. The GPU tier checks the streams themselves
(tests/engine/deepseek_v4/test_deepseek_v4_lanes.py)."""

from __future__ import annotations

import pytest
import torch

from engine.errors import WorkspaceExhausted
from engine.models.deepseek_v4.step.decode_ops import DecodeRows
from engine.side_lane import SideLane
from engine.workspace import Workspace


def _lane(defer: bool = False) -> SideLane:
    return SideLane(torch.device("cpu"), defer=defer)


def _nothing() -> None:
    pass


def test_every_fork_is_joined_by_the_end_of_the_step() -> None:
    lane = _lane()
    a, b = torch.ones(1), torch.ones(2)
    lane.run(_nothing, keep=(a,))
    lane.run(_nothing, keep=(b,))  # the side continues after the main stream's work since
    assert [t.numel() for t in lane._keep] == [1, 2]
    lane.join()
    assert lane._keep == []
    lane.join()  # a second join is harmless
    lane.run(_nothing)
    with pytest.raises(RuntimeError, match="never joined"):
        lane.close()
    lane.begin()  # a new step joins what a failed one left open
    lane.close()


@pytest.mark.parametrize("defer", [False, True])
def test_side_work_runs_in_order_and_by_the_join(defer) -> None:
    lane = _lane(defer)
    log: list[str] = []
    lane.run(lambda: log.append("side 1"))
    log.append("main")
    lane.run(lambda: log.append("side 2"))
    lane.join()
    log.append("after join")
    # eager: the side where it was issued; deferred: all of it at the join, after the main's
    assert log == (["main", "side 1", "side 2", "after join"] if defer
                   else ["side 1", "main", "side 2", "after join"])


def test_deferred_side_work_is_dropped_by_a_new_step() -> None:
    lane = _lane(defer=True)
    log: list[str] = []
    lane.run(lambda: log.append("stale"))
    lane.begin()
    lane.close()
    assert log == []


def test_defer_is_a_cpu_schedule() -> None:
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="CPU test schedule"):
            SideLane(torch.device("cuda"), defer=True)


@pytest.mark.parametrize("defer", [False, True])
def test_bindings_are_restored_even_when_the_side_fails(defer) -> None:
    lane = _lane(defer)
    state = {"ws": "main"}
    seen: list[str] = []

    def bind():
        state["ws"] = "side"
        return lambda: state.update(ws="main")

    lane.run(lambda: seen.append(state["ws"]), bind=bind)
    lane.join()
    assert seen == ["side"] and state["ws"] == "main"

    def boom() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        lane.run(boom, bind=bind)
        lane.join()
    assert state["ws"] == "main"


def test_shared_state_made_on_the_side_is_refused() -> None:
    rows = DecodeRows(torch.tensor([0, 1]), torch.tensor([5, 9]), torch.zeros(2, 3, dtype=torch.long))
    _ = rows.writer
    lane = _lane()
    lane.run(lambda: rows.writer, frozen=rows.shared_keys)  # reading what exists is fine
    lane.join()
    with pytest.raises(RuntimeError, match="ring"):
        # made on the side: the main stream could read it unordered
        lane.run(lambda: rows.ring_rows(4), frozen=rows.shared_keys)
    lane.join()
    # made on the main stream first, then read on the side: allowed
    lane.run(lambda: rows.ring_rows(4), frozen=rows.shared_keys)
    lane.join()


def test_workspace_lane_is_its_own_fixed_arena() -> None:
    ws = Workspace(1 << 16, "cpu")
    with ws.scope():
        side = ws.lane(1000, caller="test.side")
        assert side.capacity == 1024  # whole 256 B units
        with side.scope():
            a = side.take((1000,), torch.uint8, caller="test.side_gemv")
            # the main arena's next frames start past the lane's bytes
            with ws.scope():
                b = ws.take((4096,), torch.uint8, caller="test.main")
                a_end = a.data_ptr() + a.numel()
                assert b.data_ptr() >= a_end or b.data_ptr() + b.numel() <= a.data_ptr()
            with pytest.raises(WorkspaceExhausted, match="test.too_big"):
                side.take((64,), torch.uint8, caller="test.too_big")
        assert ws.peak_bytes >= 1024 + 4096
    # released with the frame that holds it
    assert ws.available == ws.capacity


def test_workspace_lane_past_the_arena_names_the_caller() -> None:
    ws = Workspace(4096, "cpu")
    with ws.scope(), pytest.raises(WorkspaceExhausted, match="deepseek_v4.decode_side_lane"):
        ws.lane(8192, caller="deepseek_v4.decode_side_lane")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_side_work_is_ordered_by_fork_and_join() -> None:
    """On a real second stream: the side sees everything issued before the fork, the main
    stream sees the side's results after the join (a long side kernel makes a missing edge
    show as a wrong sum)."""
    dev = torch.device("cuda")
    lane = SideLane(dev)
    x = torch.zeros(1 << 22, device=dev)
    x += 1  # main, before the fork
    box: dict[str, torch.Tensor] = {}

    def side() -> None:
        y = x * 2
        for _ in range(20):
            y = y + 1  # long enough to still run when the main stream reaches the join
        box["y"] = y

    lane.run(side, keep=(x,))
    lane.join()
    assert float(box["y"].sum()) == (2 + 20) * x.numel()
