"""The package's imports point down its data flow, and no module imports itself back.

Every ``import`` statement of ``harness/`` counts, at module level or inside a
function: a cycle broken by a function-level import is still a cycle.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

HARNESS = Path(__file__).resolve().parents[1] / "harness"

# Bottom to top (DESIGN.md section 1): each part may import the parts below it and itself.
LAYERS: tuple[frozenset[str], ...] = tuple(
    frozenset(names.split())
    for names in (
        # vocabulary and plumbing every part shares
        "errors naming nvml dtypes extras fileio documents globalstate limits opnames outputs precision fxutil weights machine modelspec docs_links",
        "frontend",
        "lowering",
        "autocast",
        "sources",
        "models zoo",
        "cache",
        "engines",
        "build",
        "bench",
        "debug",
        "benchmarks",
        "project",
        "cli",
        "smoke __main__",
    )
)
RANK = {part: rank for rank, layer in enumerate(LAYERS) for part in layer}


def _modules() -> dict[str, Path]:
    found = {}
    for path in HARNESS.rglob("*.py"):
        parts = path.relative_to(HARNESS.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The harness modules ``module`` imports (a name imported from a package counts as its module)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], *([base] if base else [])])
            for alias in node.names:
                out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {name for name in out if name in known and name != module}


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(name, path, known) for name, path in known.items()}


def _part(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "__init__"


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a part above the importer's in :data:`LAYERS`."""
    return [
        f"{module} -> {target}"
        for module, targets in sorted(graph.items())
        for target in sorted(targets)
        if _part(module) in RANK and _part(target) in RANK and RANK[_part(target)] > RANK[_part(module)]
    ]


def test_no_module_of_the_harness_imports_itself_back():
    assert cycles(_graph()) == []


def test_every_import_points_down_the_data_flow():
    graph = _graph()
    unplaced = sorted({_part(m) for m in graph} - set(RANK) - {"__init__"})
    assert unplaced == [], f"place these parts of harness/ in LAYERS: {unplaced}"
    assert upward(graph) == []


def test_the_walk_sees_a_cycle_through_a_function_level_import_and_an_upward_import(tmp_path, monkeypatch):
    package = tmp_path / "harness"
    (package / "engines").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "errors.py").write_text("from harness.engines import backend\n")
    (package / "engines" / "__init__.py").write_text("")
    (package / "engines" / "backend.py").write_text("def f():\n    from harness import errors\n")
    monkeypatch.setattr(sys.modules[__name__], "HARNESS", package)
    graph = _graph()
    assert cycles(graph) == [["harness.engines.backend", "harness.errors"]]
    assert upward(graph) == ["harness.errors -> harness.engines.backend"]
