"""A worker process for tests whose steps raise, or whose process dies, on a chosen token id.

    python -m tests.helpers.poison_worker <prefill|decode> [the worker's flags]

with ``POISON_RAISE_TOKEN`` and/or ``POISON_DIE_TOKEN`` in its environment: a step holding a
chunk with that token raises RuntimeError, or SIGKILLs its own process (a crash that one request
causes, every time it runs). This lives under tests/ and wraps `ModelRunner.execute` before
handing over to `launch.cli`: the product has no such switch and never reads these variables.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from engine.model_runner import ModelRunner
from launch.cli import main


def _token(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value else None


def install(raise_token: int | None, die_token: int | None) -> None:
    real = ModelRunner.execute

    def execute(self: ModelRunner, out: Any, *args: Any, **kw: Any) -> dict[str, int]:
        tokens = {t for c in out.chunks for t in c.token_ids}
        if die_token is not None and die_token in tokens:
            os.kill(os.getpid(), signal.SIGKILL)
        if raise_token is not None and raise_token in tokens:
            raise RuntimeError(f"test poison: token {raise_token} in the step")
        return real(self, out, *args, **kw)

    ModelRunner.execute = execute  # type: ignore[method-assign]


if __name__ == "__main__":
    install(_token("POISON_RAISE_TOKEN"), _token("POISON_DIE_TOKEN"))
    sys.exit(main(sys.argv[1:]))
