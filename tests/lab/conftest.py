"""Tests of the lab (lab/): its benchmarks run at toy sizes on the CPU, the Triton ones through
the interpreter with the kernel tests' own fixture."""

from __future__ import annotations

from tests.kernels.conftest import interpret  # noqa: F401  (a fixture, found by name)
