"""Writing a benchmark's result rows to the JSON file its ``--json``/``--out`` flag names."""

from __future__ import annotations

import json
from typing import Any


def write_json(path: str | None, data: Any, indent: int = 1) -> None:
    """``data`` as JSON at ``path``; nothing when no path was given."""
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=indent)
