"""Which way imports run, checked on every module of the tree (docs/architecture.md).

Each module is parsed, not imported, so a lazy import inside a function counts as much as one at
the top: a rule broken only on a rare path is still broken. Relative imports are resolved
against the module's package; ``importlib.import_module("x")`` with a literal name counts too.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Our top-level packages; anything else imported is a third-party or standard module.
OURS = ("bench", "common", "decode_worker", "engine", "kernels", "lab", "launch", "prefill_worker",
        "proto", "router", "worker")
RUNTIME = ("common", "decode_worker", "engine", "kernels", "prefill_worker", "proto", "router",
           "worker")
SERVICES = ("router", "prefill_worker", "decode_worker", "worker")

# package -> top-level names it must never import, and why.
FORBIDDEN: dict[str, dict[str, str]] = {
    "kernels": {p: "kernels/ is a library: it imports nothing of ours" for p in OURS
                if p != "kernels"},
    "proto": {p: "proto/ is the wire contract alone" for p in OURS if p != "proto"},
    "engine": {p: "the engine never imports a service, the launcher or a benchmark"
               for p in (*SERVICES, "launch", "bench")},
    "router": {
        **{p: "the router never imports torch, the engine, kernels or the worker runtime"
           for p in ("torch", "triton", "engine", "kernels", "worker")},
        "prefill_worker": "the router talks to workers over gRPC only",
        "decode_worker": "the router talks to workers over gRPC only",
        "bench": "no runtime package imports bench/",
    },
    "prefill_worker": {"decode_worker": "the workers never import each other",
                       "router": "a worker never imports the router",
                       "bench": "no runtime package imports bench/"},
    "decode_worker": {"prefill_worker": "the workers never import each other",
                      "router": "a worker never imports the router",
                      "bench": "no runtime package imports bench/"},
    "worker": {p: "the worker runtime is below the role packages and the router"
               for p in ("router", "prefill_worker", "decode_worker")}
    | {"launch": "the worker runtime is started by launch/, never the other way",
       "bench": "no runtime package imports bench/"},
    "common": {p: "common/ is torch-free and below every package that uses it"
               for p in ("torch", "triton", *SERVICES, "engine", "kernels", "launch", "bench")},
    "launch": {p: "`bulkhead up` and the launcher never import torch: they start the rest as "
                  "processes and import a subcommand's module by name when it runs"
               for p in ("torch", "triton", "engine", "kernels", "bench")},
    "bench": {p: "`bulkhead bench` drives the services as processes, over HTTP"
              for p in ("router", "prefill_worker", "decode_worker")},
}
# The lab (benchmarks, probes, GPU scripts) may import the product; nothing of the product
# imports the lab.
for _package in OURS:
    if _package != "lab":
        FORBIDDEN.setdefault(_package, {})["lab"] = "the lab imports the product, never the reverse"

# The floors of the house, bottom up: an import between two of our packages runs to a lower floor,
# never across one (two packages of a floor are strangers) and never back up
# (docs/architecture.md, "Import rules").
FLOORS: dict[str, int] = {
    "proto": 0, "common": 0, "kernels": 0,
    "engine": 1,
    "worker": 2,
    "router": 3, "prefill_worker": 3, "decode_worker": 3,
    "launch": 4,
    "bench": 5,
    "lab": 6,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) for every import in the file, lazy ones included."""
    tree = ast.parse(path.read_text(), filename=str(path))
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            found.append((node.lineno, mod))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append((node.lineno, node.args[0].value))
    return found


def package_files(package: str) -> list[Path]:
    return sorted(p for p in (REPO / package).rglob("*.py") if "__pycache__" not in p.parts)


def violations(package: str) -> list[str]:
    rules = FORBIDDEN[package]
    out = []
    for path in package_files(package):
        for line, mod in imported_modules(path):
            top = mod.split(".")[0]
            if top in rules:
                out.append(f"{path.relative_to(REPO)}:{line} imports {mod}: {rules[top]}")
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_keeps_its_import_rules(package: str) -> None:
    assert package_files(package), f"{package}/ has no modules: the rule would check nothing"
    assert violations(package) == []


@pytest.mark.parametrize("package", RUNTIME)
def test_no_runtime_package_imports_bench_or_the_lab(package: str) -> None:
    bad = [f"{p.relative_to(REPO)}:{line} imports {mod}"
           for p in package_files(package) for line, mod in imported_modules(p)
           if mod.split(".")[0] in ("bench", "lab")]
    assert bad == []


def test_every_package_of_ours_is_known() -> None:
    # A new top-level package must be placed in the rules above, not slip past them.
    found = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests"}
    assert found == set(OURS) == set(FLOORS)


def upward_imports(package: str) -> list[str]:
    """Imports from ``package`` to another package of ours that is not on a lower floor."""
    out = []
    for path in package_files(package):
        for line, mod in imported_modules(path):
            top = mod.split(".")[0]
            if top in FLOORS and top != package and FLOORS[top] >= FLOORS[package]:
                out.append(f"{path.relative_to(REPO)}:{line} imports {mod}: floor "
                           f"{FLOORS[top]} from floor {FLOORS[package]}")
    return out


@pytest.mark.parametrize("package", sorted(FLOORS))
def test_imports_run_down_the_floors(package: str) -> None:
    assert upward_imports(package) == []


def test_an_import_back_up_a_floor_is_reported(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # engine (floor 1) reaching for the worker runtime (2) lazily, and a router module for a
    # prefill worker's (same floor): both reported; the worker taking the engine is not.
    for pkg, body in (("engine", "def f():\n    from worker.codec import status_of\n"),
                      ("router", "import prefill_worker.server\n"),
                      ("worker", "from engine.llm_engine import LLMEngine\n")):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
        (tmp_path / pkg / "m.py").write_text(body)
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert [v.split(" imports ")[1].split(":")[0] for v in upward_imports("engine")] == [
        "worker.codec"]
    assert len(upward_imports("router")) == 1 and upward_imports("worker") == []


def test_the_parser_sees_imports_the_rules_rely_on() -> None:
    # The engine really imports kernels, and a worker really imports the runtime: if the parser
    # missed imports, every rule above would pass vacuously.
    engine = {m for p in package_files("engine") for _, m in imported_modules(p)}
    decode = {m for p in package_files("decode_worker") for _, m in imported_modules(p)}
    assert any(m.startswith("kernels") for m in engine)
    assert any(m.startswith("worker.") for m in decode)


def test_a_broken_rule_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The same check on a throwaway tree that breaks three rules, a lazy and a relative import
    # among them.
    (tmp_path / "router").mkdir()
    (tmp_path / "router" / "__init__.py").write_text("")
    (tmp_path / "router" / "app.py").write_text(
        "def f():\n    import torch\n    from engine.llm_engine import LLMEngine\n")
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    (tmp_path / "kernels" / "k.py").write_text("from ..engine import config\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    router = violations("router")
    assert [v.split(":")[0] for v in router] == ["router/app.py", "router/app.py"]
    assert "imports torch" in router[0] and "imports engine.llm_engine" in router[1]
    kernels = violations("kernels")
    assert len(kernels) == 1 and "imports engine" in kernels[0]


# Where proto messages may be read or built (docs/architecture.md, "one codec per edge"): on the
# router's side the gRPC client, its codec and the decoder of WorkerInfo (GetInfo answers and
# registry values); on the workers' side the servicers, the worker codec and the registration that
# publishes WorkerInfo.
PROTO_EDGE = {
    "router": {"router.worker_client", "router.worker_codec", "router.worker_status"},
    "worker": {"worker.codec", "worker.worker_base", "worker.registration"},
    "prefill_worker": {"prefill_worker.server"},
    "decode_worker": {"decode_worker.server"},
}


@pytest.mark.parametrize("package", sorted(PROTO_EDGE))
def test_proto_messages_stop_at_the_edge(package: str) -> None:
    bad = [f"{p.relative_to(REPO)}:{line} imports {mod}"
           for p in package_files(package) for line, mod in imported_modules(p)
           if mod.split(".")[0] == "proto" and module_name(p) not in PROTO_EDGE[package]]
    assert bad == []
    # and the edge modules really use proto: the rule is not checking an empty set
    users = {module_name(p) for p in package_files(package)
             for _, mod in imported_modules(p) if mod.split(".")[0] == "proto"}
    assert users <= PROTO_EDGE[package] and users


def test_one_settings_loader() -> None:
    # Router and workers load settings through common/settings_loader.py; neither settings
    # module parses YAML or the environment itself.
    for path in (REPO / "router" / "settings.py", REPO / "common" / "settings.py"):
        mods = {m for _, m in imported_modules(path)}
        assert "common.settings_loader" in mods or "common" in mods, path
        assert not {"yaml", "os"} & mods, f"{path.relative_to(REPO)} loads settings itself"
