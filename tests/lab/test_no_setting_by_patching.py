"""What we measure is what a user runs: the kernel choices, the KV dtype and every other engine
setting reach an engine through its EngineConfig (worker settings -> EngineConfig.kernels and
friends), never by patching a model family's class. A benchmark that did so measured a product
no user could start."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# a family class's constructor or class attribute replaced, a constructor pre-bound with
# arguments, or a family patched through monkeypatch
PATCHING = re.compile(r"\w*Family\.\w+\s*=(?!=)|partialmethod\(|setattr\(\s*\w*Family\b")


def _hits(folders: tuple[str, ...]) -> list[str]:
    hits = []
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for no, line in enumerate(path.read_text().splitlines(), 1):
                if PATCHING.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{no}: {line.strip()}")
    return hits


def test_no_code_sets_a_setting_by_patching_a_family_class() -> None:
    hits = _hits(("bench", "lab", "scripts", "engine", "worker", "launch", "prefill_worker",
                  "decode_worker", "tests"))
    hits = [h for h in hits if not h.startswith("tests/lab/test_no_setting_by_patching.py")]
    assert not hits, "settings changed by patching a class:\n" + "\n".join(hits)


def test_the_check_sees_the_patterns_it_forbids() -> None:
    for line in ("DeepseekV4Family.__init__ = partialmethod(orig, backend=b)",
                 "DeepseekV4Family.plan_decode = decode",
                 'monkeypatch.setattr(DeepseekV4Family, "plan_decode", "fused")'):
        assert PATCHING.search(line), line
    assert not PATCHING.search("if DeepseekV4Family.uses_cuda_graphs == x:")
    assert not PATCHING.search("family = family_class(cfg)")
