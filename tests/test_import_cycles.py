"""No import cycles between our modules (docs/architecture.md, "The tree").

Every first-party module is parsed, not imported, and every import in it counts: those at the
top, those inside functions and those under ``if TYPE_CHECKING:``. A cycle hidden behind a lazy
or type-only import is still a cycle: it says two modules are one concern, or that a shared
vocabulary wants its own leaf module. ``from pkg import name`` where ``name`` is a submodule of
``pkg`` is an import of that submodule (and of ``pkg`` itself, whose ``__init__`` runs first).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("bench", "common", "decode_worker", "engine", "kernels", "lab", "launch",
            "prefill_worker", "proto", "router", "worker")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def first_party_modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            if "__pycache__" not in path.parts:
                found[module_name(path)] = path
    return found


def imported_names(path: Path, name: str) -> list[tuple[int, list[str]]]:
    """For every import in ``path``: (line, the dotted names it may mean, most specific first).
    ``from a import b`` may mean the submodule ``a.b`` or a name defined in ``a``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[int, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, [alias.name]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            found += [(node.lineno, [f"{mod}.{alias.name}", mod]) for alias in node.names
                      if alias.name != "*"]
            if any(alias.name == "*" for alias in node.names):
                found.append((node.lineno, [mod]))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append((node.lineno, [node.args[0].value]))
    return found


def _resolve(dotted: list[str], modules: dict[str, Path]) -> str | None:
    """The first-party module an import means: the first candidate, or its longest prefix,
    that is one of our modules."""
    for candidate in dotted:
        parts = candidate.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in modules:
                return ".".join(parts[:i])
    return None


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {first-party module it imports: first line}. Importing ``a.b.c`` runs
    ``a/__init__`` and ``a/b/__init__`` first, so those count too, except the importer's own
    enclosing packages (they are already running when it is imported)."""
    modules = first_party_modules()
    graph: dict[str, dict[str, int]] = {m: {} for m in modules}
    for name, path in modules.items():
        for line, dotted in imported_names(path, name):
            target = _resolve(dotted, modules)
            if target is None or target == name:
                continue
            graph[name].setdefault(target, line)
            parts = target.split(".")
            for i in range(1, len(parts)):
                ancestor = ".".join(parts[:i])
                if ancestor in modules and not (name + ".").startswith(ancestor + "."):
                    graph[name].setdefault(ancestor, line)
    return graph


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components of more than one module only."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def _checked_graph() -> dict[str, dict[str, int]]:
    return import_graph()


def _describe(component: list[str], graph: dict[str, dict[str, int]]) -> str:
    members = set(component)
    edges = [f"    {a} -> {b} (line {graph[a][b]})"
             for a in component for b in sorted(graph[a]) if b in members]
    return "cycle of " + ", ".join(component) + ":\n" + "\n".join(edges)


def test_no_import_cycles() -> None:
    graph = _checked_graph()
    cycles = strongly_connected(graph)
    assert not cycles, "\n".join(_describe(c, graph) for c in cycles)


# The engine's vocabulary (docs/architecture.md, "Inside engine/"): leaves that the planner, the
# families, the runner, the engine and the workers' KV store all speak, so they import nothing
# of ours but what is listed here. A leaf that grows an import upward brings the cycles back.
VOCABULARY_LEAVES: dict[str, set[str]] = {
    "engine.errors": set(),
    "engine.kv_layout": set(),
    "engine.memory_plan": {"engine.config", "engine.errors", "engine.kv_layout"},
    "engine.config": {"engine.errors"},
    "engine.models": set(),
    "engine.models.registry": set(),
    "engine.model_config": {"engine.errors", "engine.models", "engine.models.registry"},
    "engine.workspace": {"engine.errors"},
    "engine.step_batch": set(),
    "engine.staged_kv": set(),
}


def test_the_vocabulary_stays_a_leaf() -> None:
    graph = import_graph()
    grown = {leaf: sorted(set(graph[leaf]) - allowed)
             for leaf, allowed in VOCABULARY_LEAVES.items() if set(graph[leaf]) - allowed}
    assert not grown, f"leaf modules import upward: {grown}"


def test_the_cycle_finder_finds_a_cycle() -> None:
    # The check above is only as good as the finder: a known loop must come back as one.
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}, "e": {"e": 5}}
    assert strongly_connected(graph) == [["a", "b", "c"]]


def test_lazy_and_type_checking_imports_count(tmp_path: Path) -> None:
    source = ("from typing import TYPE_CHECKING\n"
              "if TYPE_CHECKING:\n    from engine.plan_terms import Term\n"
              "def f():\n    from .sibling import g\n    import engine.kv_cache\n")
    path = tmp_path / "mod.py"
    path.write_text(source)
    names = {n for _, dotted in imported_names(path, "engine.pkg.mod") for n in dotted}
    assert {"engine.plan_terms.Term", "engine.pkg.sibling.g", "engine.kv_cache"} <= names


def test_the_graph_sees_the_whole_tree() -> None:
    graph = import_graph()
    assert len(graph) > 200, "too few modules found: the check would pass on nothing"
    assert "engine.llm_engine" in graph and graph["engine.llm_engine"]
