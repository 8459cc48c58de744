"""Rewrites the router and worker settings tables of deploy/README.md from the settings classes
(their field docs and defaults), so the page lists every setting with its default as the code
has it. tests/deploy/test_settings_tables.py fails when the page is stale.

    python scripts/settings_tables.py [deploy/README.md]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.settings import settings_table as worker_table  # noqa: E402
from router.settings import settings_table as router_table  # noqa: E402

SECTIONS = (("### Router (`bulkhead router --help`)", router_table),
            ("### Workers (`bulkhead prefill --help`, `bulkhead decode --help`)", worker_table))


def rewrite(text: str) -> str:
    """``text`` with the table under each section's heading replaced by the current one."""
    lines = text.splitlines()
    for heading, table in SECTIONS:
        start = lines.index(heading)
        first = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("|"))
        end = next((i for i in range(first, len(lines)) if not lines[i].startswith("|")),
                   len(lines))
        lines[first:end] = table().splitlines()
    return "\n".join(lines) + ("\n" if text.endswith("\n") else "")


def main(argv: list[str]) -> int:
    path = Path(argv[0]) if argv else ROOT / "deploy" / "README.md"
    path.write_text(rewrite(path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
