import pytest
import torch

from engine.errors import WorkspaceExhausted
from engine.workspace import Workspace


def test_scopes_reuse_space_and_record_peak():
    ws = Workspace(4096, "cpu")
    with ws.scope():
        a = ws.take((16,), torch.float32, caller="a")
        with ws.scope():
            ws.take((256,), torch.float32, caller="b")
        c = ws.take((16,), torch.float32, caller="c")
        assert c.data_ptr() == a.data_ptr() + 256  # b's space was reused
    assert ws.peak_bytes == 256 + 1024
    assert ws.available == ws.capacity


def test_exhaustion_names_caller_and_sizes_before_and_after_lock():
    ws = Workspace(1024, "cpu")
    with ws.scope(), pytest.raises(WorkspaceExhausted, match="big.thing asked for 4096 bytes"):
        ws.take((1024,), torch.float32, caller="big.thing")
    ws.lock()
    with ws.scope():
        ws.take((64,), torch.float32, caller="ok")
        with pytest.raises(WorkspaceExhausted) as e:
            ws.take((256,), torch.float32, caller="attention.tile")
    assert e.value.caller == "attention.tile"
    assert e.value.requested == 1024 and e.value.available == 768
    assert ws.capacity == 1024  # never grew


def test_take_outside_scope_is_a_programmer_error():
    ws = Workspace(1024, "cpu")
    with pytest.raises(AssertionError):
        ws.take((1,), torch.float32, caller="x")
