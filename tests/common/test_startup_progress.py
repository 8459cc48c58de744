"""The start-up progress contract between a worker and `bulkhead up`: lines the worker prints
are found in its log wherever the prefix sits, each once, and a half-written line waits."""

from __future__ import annotations

import io
from pathlib import Path

from common.startup_progress import PREFIX, ProgressFollower, StartupProgress


def test_follower_reads_each_whole_progress_line_once(tmp_path: Path) -> None:
    log = tmp_path / "decode.log"
    follower = ProgressFollower(log)
    assert follower.new_steps() == []  # no file yet
    out = io.StringIO()
    StartupProgress(out)("loading weights from m.gguf")
    log.write_text("2026-12-03 INFO lmcache: noise\n" + out.getvalue()
                   + f"{PREFIX} warm-up 1/3: prefill")  # the last line is not finished
    steps = follower.new_steps()
    assert len(steps) == 1 and steps[0].startswith("loading weights from m.gguf [+")
    with log.open("a") as f:
        f.write(" chunk [+3.0 s]\nTraceback: not a step\n")
    assert follower.new_steps() == ["warm-up 1/3: prefill chunk [+3.0 s]"]
    assert follower.new_steps() == []
