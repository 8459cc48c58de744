"""When the prefill side stops waiting for its stored KV to become visible (worker/store_visibility.py)."""

from __future__ import annotations

import itertools
import time

from worker.store_visibility import wait_visible


def test_returns_as_soon_as_every_token_is_visible() -> None:
    counts = iter([0, 16, 32])
    assert wait_visible(lambda: next(counts), 32, lambda: True, 5.0, None, "s") == 32


def test_an_unreachable_store_is_not_waited_for() -> None:
    t0 = time.monotonic()
    assert wait_visible(lambda: 16, 32, lambda: False, 30.0, None, "s") == 16
    assert time.monotonic() - t0 < 1.0


def test_a_stalled_store_stops_the_wait_before_the_deadline() -> None:
    t0 = time.monotonic()
    assert wait_visible(lambda: 16, 32, lambda: True, 30.0, 0.1, "s") == 16
    assert 0.1 <= time.monotonic() - t0 < 5.0


def test_the_deadline_ends_a_wait_that_still_makes_progress() -> None:
    counts = itertools.count()
    t0 = time.monotonic()
    got = wait_visible(lambda: next(counts), 10**9, lambda: True, 0.2, 0.05, "s")
    assert 0 < got < 10**9 and 0.2 <= time.monotonic() - t0 < 5.0
