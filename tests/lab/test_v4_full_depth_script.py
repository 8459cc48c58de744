"""lab/scripts/v4_full_depth.sh refuses what it cannot run before it starts anything (no GPU needed):
no output folder, or a part it does not know, each with a message naming the problem."""

from __future__ import annotations

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "lab" / "scripts" / "v4_full_depth.sh"


def test_usage_without_out_dir() -> None:
    r = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, check=False)
    assert r.returncode != 0 and "usage: lab/scripts/v4_full_depth.sh OUT_DIR" in r.stderr


def test_unknown_part_named(tmp_path) -> None:
    r = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "o"), "prompt", "decoding"],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 2 and "unknown part: decoding" in r.stderr
    assert not (tmp_path / "o" / "prompt.log").exists()  # checked before anything ran
