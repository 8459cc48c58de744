"""The suite's start-up budget (tests/helpers/startup_budget.py): one stated number, scaled by
the machine's load and capped, and a wait that runs out fails with the processes' log tails."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers import startup_budget
from tests.helpers.up_process import wait_until_up


def test_budget_scales_with_load_and_is_capped(monkeypatch) -> None:
    cores = os.cpu_count() or 1
    monkeypatch.setattr(os, "getloadavg", lambda: (0.1, 0.0, 0.0))
    assert startup_budget.startup_budget_s() == startup_budget.BASE_S
    monkeypatch.setattr(os, "getloadavg", lambda: (2.0 * cores, 0.0, 0.0))
    assert startup_budget.startup_budget_s(0.5) == pytest.approx(startup_budget.BASE_S)
    monkeypatch.setattr(os, "getloadavg", lambda: (50.0 * cores, 0.0, 0.0))
    assert startup_budget.startup_budget_s() == startup_budget.BASE_S * startup_budget.MAX_SCALE


def test_a_start_past_its_budget_fails_with_the_log_tails(tmp_path: Path) -> None:
    out = tmp_path / "up.out"
    out.write_text("[  1.0 s] prefill   loading weights from m\n")
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "prefill.log").write_text("".join(f"line {i}\n" for i in range(100)) + "MemoryError\n")
    proc = subprocess.Popen(["sleep", "30"])
    try:
        with pytest.raises(AssertionError) as err:
            wait_until_up(proc, out, budget_s=0.3, poll_s=0.05, log_dir=logs)
    finally:
        proc.kill()
        proc.wait()
    text = str(err.value)
    assert "not healthy after 0 s (the start-up budget" in text and "loading weights" in text
    assert "--- prefill.log (last 30 lines)" in text and "MemoryError" in text
    assert "line 69\n" not in text  # only the tail
