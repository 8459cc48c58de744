"""The skip every test that needs the default model takes when it is not on this machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.default_model import DefaultModelMissing, default_model_path


def default_model_or_skip() -> Path:
    """The default model's path; skips the calling test (with the reason) when it is missing."""
    try:
        return default_model_path()
    except DefaultModelMissing as exc:
        pytest.skip(str(exc))
