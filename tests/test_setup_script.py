"""scripts/setup.sh installs once: run again on the venv the suite runs in (./scripts/test made
it), it finds the marker for its dependency set and installs nothing, in seconds."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_second_setup_installs_nothing() -> None:
    venv = os.environ.get("VIRTUAL_ENV", "")
    if not venv or not (Path(venv) / ".bulkhead-installed-test").exists():
        pytest.skip("not running in a venv made by scripts/setup.sh (run ./scripts/test)")
    env = {**os.environ, "BULKHEAD_VENV": venv}
    for profile in ("test", "runtime"):  # a test install holds the runtime too
        started = time.monotonic()
        out = subprocess.run([str(REPO / "scripts" / "setup.sh"), profile], env=env,
                             capture_output=True, text=True, timeout=120, check=True).stdout
        assert f"{profile} dependencies already installed in {venv}" in out, out
        assert time.monotonic() - started < 30, out
