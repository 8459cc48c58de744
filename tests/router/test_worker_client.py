"""WorkerClient: an answer grpc.aio hands back as None (it swallows a deserialization error, or
a call ends OK without a message) is a WorkerCallError naming the call, never a None that fails
later as `'NoneType' object has no attribute 'worker_id'` in the registry."""

from __future__ import annotations

import grpc
import pytest

from router.errors import WorkerCallError
from router.worker_client import EMPTY_ANSWER, CallDeadlines, WorkerClient


async def test_an_empty_answer_is_a_worker_call_error() -> None:
    client = WorkerClient("127.0.0.1:1", CallDeadlines(1.0, 1.0, 1.0, 1.0))

    async def answers_none(request, timeout=None, metadata=None):  # what grpc.aio returned
        return None

    client._stub.GetInfo = answers_none
    try:
        with pytest.raises(WorkerCallError) as exc:
            await client.get_info()
    finally:
        await client.close()
    assert exc.value.code == grpc.StatusCode.UNKNOWN and exc.value.details == EMPTY_ANSWER
    assert exc.value.phase == "info"
