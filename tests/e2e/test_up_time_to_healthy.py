"""How long `bulkhead up` takes to be healthy once installed, with the defaults a user gets
(SmolLM2-135M-Instruct Q4_1 GGUF, max context 4096, batch 8, chunk 512), and that it tells
what it is doing meanwhile: each worker's load and warm-up steps with the time so far, then the
time to healthy. The README quotes the figure this test prints (`-s` shows it)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from launch.launcher import free_port
from tests.helpers.default_model import default_model_or_skip
from tests.helpers.startup_budget import startup_budget_s
from tests.helpers.up_process import stop_up, up_process, wait_until_up

pytestmark = pytest.mark.slow  # two workers warm up the full default plan: ~1 min on 2 cores

# Generous: CI shares its 2 cores; on a quiet machine this takes about a minute (README).
BUDGET_S = float(os.environ.get("BULKHEAD_UP_HEALTHY_BUDGET_S", "0")) or startup_budget_s(4 / 3)


def test_up_reports_progress_and_time_to_healthy(tmp_path: Path) -> None:
    default_model_or_skip()
    port = free_port()
    out_path = tmp_path / "up.out"
    # What a user gets: no limits or thread counts from the environment of the test run.
    env = {k: v for k, v in os.environ.items() if not k.startswith("BULKHEAD_")}
    with up_process(["--port", str(port), "--log-dir", str(tmp_path / "logs")],
                    out_path, env) as proc:
        measured_s = wait_until_up(proc, out_path, BUDGET_S, log_dir=tmp_path / "logs")
        text = out_path.read_text()
        reported = re.search(r"healthy after (\d+\.\d) s", text)
        assert reported, text
        # The figure printed covers start() only (not the interpreter's start): at most ours.
        assert 0 < float(reported.group(1)) <= measured_s + 0.1, text
        for role in ("prefill", "decode"):
            steps = re.findall(rf"^\[\s*(\d+\.\d) s\] {role}\s+(.*)$", text, re.MULTILINE)
            names = [s for _, s in steps]
            assert any(s.startswith("loading weights") for s in names), text
            assert any(s.startswith("device cpu, ") and "; kernels: PyTorch ops on CPU" in s
                       for s in names), text  # the device line, first of the worker's steps
            warmups = [s for s in names if re.match(r"warm-up \d", s)]
            assert [w.split(":")[0] for w in warmups] == [f"warm-up {k}/3" for k in (1, 2, 3)]
            assert any(s.startswith("serving on ") for s in names), text
            times = [float(t) for t, _ in steps]
            assert times == sorted(times), text
        print(f"\nbulkhead up: healthy after {reported.group(1)} s as reported, "
              f"{measured_s:.1f} s from process start")
        stop_up(proc, out_path)
