"""Run a bad request while plain streams run beside it: the test of a failure that must stay
with its own request."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

import openai


def beside_plain_streams(bad: Callable[[], object], plain_stream: Callable[[int], Iterable[Any]],
                         num_streams: int = 3) -> object:
    """Run ``bad`` while ``num_streams`` streams of ``plain_stream(i)`` (OpenAI stream chunks)
    run; -> what ``bad`` returned or the ``openai.APIError`` it raised. Asserts that every plain
    stream finished by its length."""
    finished: list[str | None] = []
    started = threading.Barrier(num_streams + 1)

    def plain(i: int) -> None:
        stream = plain_stream(i)
        started.wait()
        reason = None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                reason = chunk.choices[0].finish_reason
        finished.append(reason)

    threads = [threading.Thread(target=plain, args=(i,)) for i in range(num_streams)]
    for t in threads:
        t.start()
    started.wait()
    try:
        result = bad()
    except openai.APIError as exc:
        result = exc
    for t in threads:
        t.join(120)
    assert finished == ["length"] * num_streams
    return result
