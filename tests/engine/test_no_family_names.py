"""Generic engine code talks to model families only through engine/models/family.py: no module
of engine/ outside engine/models/ names a family or its private state (code or comments)."""

from __future__ import annotations

import re
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "engine"
# Names of the DeepSeek-V4 family and of the per-slot state it used to leak into the engine.
FORBIDDEN = re.compile(r"deepseek|\bv4\b|slot_state|state_rows|kept_slot|keep_slot", re.I)


def test_engine_outside_models_names_no_family() -> None:
    hits = []
    for path in sorted(ENGINE.rglob("*.py")):
        if "models" in path.relative_to(ENGINE).parts:
            continue
        for no, line in enumerate(path.read_text().splitlines(), 1):
            if FORBIDDEN.search(line):
                hits.append(f"{path.relative_to(ENGINE.parent)}:{no}: {line.strip()}")
    assert not hits, "family names outside engine/models/:\n" + "\n".join(hits)


def test_the_check_would_see_a_family_name() -> None:
    assert FORBIDDEN.search('if model.family == "deepseek_v4":')
    assert FORBIDDEN.search("self.slot_state = None")
    assert not FORBIDDEN.search("family = family_class(model_config)")
