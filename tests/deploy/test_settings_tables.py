"""deploy/README.md lists every router and worker setting with its default as the code has it
(regenerate with ``python scripts/settings_tables.py``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _script():  # noqa: ANN202 - the module
    spec = importlib.util.spec_from_file_location("settings_tables",
                                                  ROOT / "scripts" / "settings_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_deploy_readme_tables_are_current() -> None:
    text = (ROOT / "deploy" / "README.md").read_text()
    assert _script().rewrite(text) == text, (
        "deploy/README.md's settings tables are stale: run python scripts/settings_tables.py")


def test_the_tables_name_the_new_settings_with_defaults() -> None:
    text = (ROOT / "deploy" / "README.md").read_text()
    for row in ("| `kv_cache_dtype` | `BULKHEAD_KV_CACHE_DTYPE` | `--kv-cache-dtype` | `'auto'`",
                "| `load_format` | `BULKHEAD_LOAD_FORMAT` | `--load-format` | `'auto'`",
                "| `max_context` | `BULKHEAD_MAX_CONTEXT` | `--max-context` | `'auto'`",
                "| `decode_loop` | `BULKHEAD_DECODE_LOOP` | `--decode-loop` | `'auto'`"):
        assert row in text
