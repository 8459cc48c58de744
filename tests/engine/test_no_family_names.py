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


# The dense families' names as code uses them (a quoted name, a comparison): their facts live in
# engine/models/ (registry.py's DENSE_TRAITS and GGUF tables, dense_family.py's tensor layout).
# Prose may still name a model ("a 128k-token Llama-3-8B prompt"); code may not branch on one.
DENSE_IN_CODE = re.compile(r"""["'](llama|mistral|qwen2|qwen3)["']""", re.I)


def _code_lines(path: Path) -> list[tuple[int, str]]:
    """Lines of ``path`` without comments and docstrings (their string tokens dropped)."""
    import io
    import tokenize

    keep: dict[int, list[str]] = {}
    prev = None
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type == tokenize.COMMENT:
            continue
        if tok.type == tokenize.STRING and prev in (None, tokenize.INDENT, tokenize.NEWLINE,
                                                   tokenize.DEDENT):
            prev = tok.type
            continue  # a docstring (a string that is a statement of its own)
        if tok.type not in (tokenize.NL, tokenize.ENCODING):
            prev = tok.type
        keep.setdefault(tok.start[0], []).append(tok.string)
    return [(no, " ".join(parts)) for no, parts in sorted(keep.items())]


def test_engine_outside_models_branches_on_no_dense_family() -> None:
    hits = []
    for path in sorted(ENGINE.rglob("*.py")):
        if "models" in path.relative_to(ENGINE).parts:
            continue
        for no, line in _code_lines(path):
            if DENSE_IN_CODE.search(line):
                hits.append(f"{path.relative_to(ENGINE.parent)}:{no}: {line.strip()}")
    assert not hits, "dense family names in engine code outside engine/models/:\n" + "\n".join(
        hits)


def test_the_dense_check_would_see_a_branch() -> None:
    assert DENSE_IN_CODE.search('qk_norm = family == "qwen3"')
    assert DENSE_IN_CODE.search("if cfg.family != 'qwen2':")
    assert not DENSE_IN_CODE.search('rope_type in ("default", "linear", "llama3", "yarn")')


def test_the_check_would_see_a_family_name() -> None:
    assert FORBIDDEN.search('if model.family == "deepseek_v4":')
    assert FORBIDDEN.search("self.slot_state = None")
    assert not FORBIDDEN.search("family = family_class(model_config)")
