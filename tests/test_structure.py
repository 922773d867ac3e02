"""The package's shape: no two packages or modules import each other, and no module grows past what fits in a head."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "src" / "draftlab"
MAX_MODULE_LINES = 450


def _unit(module: str) -> str:
    """The package (draftlab.perf) or top-level module (draftlab.api) a dotted module name belongs to."""
    parts = module.split(".")
    return ".".join(parts[:2])


def _module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every draftlab module `path` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("draftlab.")}


def unit_graph() -> dict[str, set[str]]:
    """draftlab's units (packages and top-level modules) -> the other units each imports."""
    graph: dict[str, set[str]] = defaultdict(set)
    for path in SOURCE.rglob("*.py"):
        source = _unit(_module_name(path))
        graph[source] |= {_unit(name) for name in _imports(path)} - {source, "draftlab"}
    return graph


def test_no_two_packages_import_each_other():
    graph = unit_graph()
    packages = {p.name for p in SOURCE.iterdir() if (p / "__init__.py").exists()}
    mutual = sorted(
        (a, b) for a in graph for b in graph[a]
        if a < b and a in graph.get(b, set()) and {a.split(".")[1], b.split(".")[1]} & packages
    )
    assert not mutual, f"packages importing each other: {mutual}"


def module_graph() -> dict[str, set[str]]:
    """draftlab's modules -> the draftlab modules each imports (at the top, inside a function, or for type checks)."""
    return {_module_name(path): _imports(path) - {_module_name(path)} for path in SOURCE.rglob("*.py")}


def test_no_two_modules_import_each_other():
    graph = module_graph()
    mutual = sorted((a, b) for a in graph for b in graph[a] if a < b and a in graph.get(b, set()))
    assert not mutual, f"modules importing each other: {mutual}"


def test_the_graph_sees_known_imports():
    graph = unit_graph()
    assert "draftlab.backends" in graph["draftlab.engine"]
    assert "draftlab.perf" in graph["draftlab.study"]  # the report shows the model's validation
    assert "draftlab.study.store" in module_graph()["draftlab.study.sweep"]


def test_no_module_is_over_the_limit():
    long = {str(p.relative_to(SOURCE)): n for p in SOURCE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"
