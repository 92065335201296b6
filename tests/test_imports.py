"""The package's modules import each other without a cycle, counting imports inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PACKAGE = "transformer_cli"


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """{module: the package's modules it imports anywhere in its file}; "__init__" is the package itself."""
    modules = {p.stem for p in package_dir.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for name in modules:
        found = set()
        for node in ast.walk(ast.parse((package_dir / f"{name}.py").read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = PACKAGE if node.level else node.module or ""
                if node.level and node.module:
                    base = f"{PACKAGE}.{node.module}"
                found.add(base)
                if base == PACKAGE:  # from transformer_cli import x: x may be a module
                    found |= {f"{PACKAGE}.{alias.name}" for alias in node.names if alias.name in modules}
        targets = {m.split(".")[1] if "." in m else "__init__" for m in found if m.split(".")[0] == PACKAGE}
        graph[name] = targets - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        for nxt in sorted(graph.get(node, ())):
            if cycle := visit(nxt, [*path, node]):
                return cycle
        done.add(node)
        return None

    for start in sorted(graph):
        if cycle := visit(start, []):
            return cycle
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph(REPO / PACKAGE)
    assert {"checkpoint", "evaluate"} <= graph["train"] and "train" in graph["cli"]  # cli: inside a function
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_imports_inside_functions_and_of_package_members_make_a_cycle(tmp_path):
    pkg = tmp_path / PACKAGE
    pkg.mkdir()
    (pkg / "__init__.py").write_text('__version__ = "0"\n')
    (pkg / "a.py").write_text("from transformer_cli.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from transformer_cli import c, __version__\n")
    (pkg / "c.py").write_text("import os\n\n\ndef g():\n    from . import a\n")
    graph = import_graph(pkg)
    assert graph == {"__init__": set(), "a": {"b"}, "b": {"c", "__init__"}, "c": {"__init__", "a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    (pkg / "c.py").write_text("import os\n")
    assert find_cycle(import_graph(pkg)) is None
