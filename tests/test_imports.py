"""The package's modules import each other without a cycle, counting imports inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PACKAGE = "transformer_cli"


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """{module: the package's modules it imports anywhere in its file}, modules named by their dotted path in the
    package ("training.loop"; a subpackage by its name, "data"); "__init__" is the package itself."""
    files = {".".join(p.relative_to(package_dir).with_suffix("").parts): p for p in package_dir.rglob("*.py")}
    files = {name.removesuffix(".__init__") if name != "__init__" else name: p for name, p in files.items()}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = PACKAGE if node.level else node.module or ""
                if node.level and node.module:
                    base = f"{PACKAGE}.{node.module}"
                found.add(base)
                found |= {f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}"[len(PACKAGE) + 1:]
                          in files}  # from transformer_cli import x: x may be a module
        targets = {m[len(PACKAGE) + 1:] or "__init__" for m in found if m.split(".")[0] == PACKAGE}
        graph[name] = {t for t in targets if t in files} - {name}
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
    assert {"checkpoint", "evaluate"} <= graph["training.classify"] and "training.classify" in graph["cli"]
    assert not {"data", "training", "evaluate"} & {t.split(".")[0] for t in graph["model"]}  # the model stands alone
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
