"""No import cycles between modules: the import graph of each package's sources, read with ``ast``
(imports at any depth count, function-level ones included, since a lazy import that dodges a cycle
is still one; imports under ``if TYPE_CHECKING:`` do not run and do not count), has no strongly
connected component of more than one module."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(p for p in (ROOT / "packages").glob("*/src/*") if (p / "__init__.py").is_file())


def module_files() -> dict[str, Path]:
    """Every module of every package's sources, by dotted name (a package by its ``__init__``)."""
    found = {}
    for src in SOURCES:
        for path in src.rglob("*.py"):
            parts = path.relative_to(src.parent).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Import statements anywhere under ``node``, except in the body of ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield from _imports(other)
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        yield from _imports(child)


def imported_modules(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that module ``name`` imports. ``from package import x`` names the
    module ``package.x`` when there is one, else ``package`` itself; relative imports are resolved
    against the module's package. (The packages above an imported module run too, but that is how
    Python imports, not a dependency this module chose: they do not count.)"""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for stmt in _imports(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(stmt, ast.Import):
            targets = [alias.name for alias in stmt.names]
        else:
            base = stmt.module or ""
            if stmt.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (stmt.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in stmt.names]
        for target in targets:
            # The deepest module of the dotted name that exists (``import a.b.c`` of a name in a.b).
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def import_graph() -> dict[str, set[str]]:
    known = module_files()
    return {name: imported_modules(name, path, known) & known.keys() for name, path in known.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iteratively: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return components


def describe(component: list[str], graph: dict[str, set[str]]) -> str:
    members = set(component)
    edges = [f"{a} -> {b}" for a in component for b in sorted(graph[a] & members)]
    return f"{', '.join(component)} ({'; '.join(edges)})"


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_no_import_cycle(source: Path) -> None:
    graph = import_graph()
    top = source.name
    cycles = [c for c in strongly_connected(graph) if len(c) > 1 and c[0].split(".")[0] == top]
    assert not cycles, "import cycles: " + " | ".join(describe(c, graph) for c in cycles)


def test_the_graph_sees_lazy_and_relative_imports_and_skips_type_checking(tmp_path: Path) -> None:
    """The reader itself, on a throw-away package: a function-level import and a relative import
    make a cycle; an import under ``if TYPE_CHECKING:`` does not."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg import b\n")
    (pkg / "b.py").write_text("from . import a\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import f\n")
    known = {"pkg": pkg / "__init__.py", **{f"pkg.{m}": pkg / f"{m}.py" for m in "abc"}}
    graph = {name: imported_modules(name, path, known) for name, path in known.items()}
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": set()}
    assert [c for c in strongly_connected(graph) if len(c) > 1] == [["pkg.a", "pkg.b"]]
