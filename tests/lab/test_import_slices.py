"""lab/bench/import_slices.py end to end on the CPU at a small size: every arm imports the whole
prompt, a sliced arm takes as many steps as its bound asks, and the one-go arm one."""

from __future__ import annotations

import json
from pathlib import Path

from lab.bench.import_slices import main


def test_import_slices_bench_runs_every_arm(tmp_path: Path) -> None:
    out = tmp_path / "import.json"
    # 1,024 tokens of 32 KiB: 32 MiB; slices of 8 MiB -> 4 steps
    assert main(["--prompt-tokens", "1024", "--chats", "1", "--chat-tokens", "256",
                 "--slices-mb", "8", "--warm-steps", "2", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    arms = {a["arm"]: a for a in got["arms"]}
    assert set(arms) == {"oneshot", "8MiB"}
    assert all(a["imported_tokens"] == 1024 for a in arms.values())
    assert arms["oneshot"]["import_steps"] == 1 and arms["8MiB"]["import_steps"] == 4
