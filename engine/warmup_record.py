"""A record that a CPU worker's warm-up passed, so that the same worker started again skips the
warm-up's steps.

On a CPU the warm-up's steps (the plan's worst cases: the largest chunk against the longest
context, a full batch of decodes, ...) measure one thing, the workspace's high-water mark,
which the plan is checked against; with SmolLM2 at a 4,096-token context they are ~26 of the
~37 s a decode worker takes to start on 2 cores. Whether they pass depends only on the model,
the engine config, torch and our code, so once they passed, a worker started with the same of
each (`bulkhead up`'s supervisor restarting it) has nothing to learn from them. The record is a
small JSON file named by a hash of exactly those: a different model file (its fingerprint), any
setting, another torch, or an edited source file of engine/ or kernels/ gives another name and
the warm-up runs. On CUDA the warm-up also measures the device's transient peak, sets the
allocation baseline and captures graphs: it always runs there, and this module is not asked.

Never holds weights or prompts; a record that cannot be read or written is ignored (logged).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_CODE_PACKAGES = ("engine", "kernels")  # the code a warm-up runs


def code_stamp() -> str:
    """Names, sizes and modification times of every source file the warm-up runs."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.blake2b(digest_size=16)
    for package in _CODE_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            st = path.stat()
            h.update(f"{path.relative_to(root)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


@dataclass(frozen=True)
class WarmupRecord:
    path: Path

    @classmethod
    def for_engine(cls, folder: str, engine_config: Any, model_fingerprint: str,
                   torch_version: str) -> WarmupRecord:
        key = hashlib.blake2b(digest_size=16)
        for part in (repr(engine_config), model_fingerprint, torch_version, code_stamp()):
            key.update(part.encode("utf-8", "surrogatepass") + b"\0")
        return cls(Path(folder) / f"warmup-passed-{key.hexdigest()}.json")

    def load(self) -> dict[str, Any] | None:
        """The report of the warm-up that passed with this key, or None."""
        try:
            return dict(json.loads(self.path.read_text()))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("warm-up record %s unreadable (%s): running the warm-up", self.path, exc)
            return None

    def save(self, report: dict[str, Any]) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".warmup-")
            with os.fdopen(fd, "w") as f:
                json.dump(report, f)
            os.replace(tmp, self.path)  # whole or not at all, for a worker starting beside
        except OSError as exc:
            log.warning("cannot write the warm-up record %s: %s", self.path, exc)
