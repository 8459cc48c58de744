"""The side lane's bookkeeping (engine/side_lane.py) and the Workspace it carves: what keeps two
streams' scratch, counters and shared state apart. CPU: no stream, issue order; the checks run
the same. The GPU tier checks the streams themselves
(tests/engine/deepseek_v4/test_deepseek_v4_lanes.py)."""

from __future__ import annotations

import pytest
import torch

from engine.errors import WorkspaceExhausted
from engine.models.deepseek_v4.decode_step import DecodeRows
from engine.side_lane import SideLane
from engine.workspace import Workspace


def _lane() -> SideLane:
    return SideLane(torch.device("cpu"))


def test_every_fork_is_joined_by_the_end_of_the_step() -> None:
    lane = _lane()
    a, b = torch.ones(1), torch.ones(2)
    with lane.fork(keep=(a,)):
        pass
    with lane.fork(keep=(b,)):  # the side continues after the main stream's work since
        pass
    assert [t.numel() for t in lane._keep] == [1, 2]
    lane.join()
    assert lane._keep == []
    lane.join()  # a second join is harmless
    with lane.fork():
        pass
    with pytest.raises(RuntimeError, match="never joined"):
        lane.close()
    lane.begin()  # a new step joins what a failed one left open
    lane.close()


def test_bindings_are_restored_even_when_the_side_fails() -> None:
    lane = _lane()
    state = {"ws": "main"}

    def bind():
        state["ws"] = "side"
        return lambda: state.update(ws="main")

    with lane.fork(bind=bind):
        assert state["ws"] == "side"
    assert state["ws"] == "main"
    lane.join()
    with pytest.raises(ValueError, match="boom"), lane.fork(bind=bind):
        raise ValueError("boom")
    assert state["ws"] == "main"


def test_shared_state_made_on_the_side_is_refused() -> None:
    rows = DecodeRows(torch.tensor([0, 1]), torch.tensor([5, 9]), torch.zeros(2, 3, dtype=torch.long))
    _ = rows.writer
    lane = _lane()
    with lane.fork(frozen=rows.shared_keys):  # reading what exists is fine
        _ = rows.writer
    lane.join()
    with pytest.raises(RuntimeError, match="ring"), lane.fork(frozen=rows.shared_keys):
        rows.ring_rows(4)  # made on the side: the main stream could read it unordered
    lane.join()
    # made on the main stream first, then read on the side: allowed
    with lane.fork(frozen=rows.shared_keys):
        rows.ring_rows(4)
    lane.join()


def test_keep_holds_the_main_tensors_until_the_join() -> None:
    lane = _lane()
    t = torch.ones(3)
    with lane.fork(keep=(t,)):
        pass
    assert lane._keep and lane._keep[0] is t
    lane.join()
    assert lane._keep == []


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
    with lane.fork(keep=(x,)):
        y = x * 2
        for _ in range(20):
            y = y + 1  # long enough to still run when the main stream reaches the join
    lane.join()
    z = y.sum()
    assert float(z) == (2 + 20) * x.numel()
