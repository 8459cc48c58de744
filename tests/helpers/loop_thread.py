"""An asyncio event loop on a background thread, for serving grpc.aio in-process while the test
itself uses plain blocking clients."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-loop",
                                        daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5.0)
